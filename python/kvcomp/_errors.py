"""The exception raised for every rejected kvcomp call."""

# Status codes of the C++ core, which carry the aclnn numbers (include/kvcomp/kvcomp.hpp).
NULL_POINTER = 161001  # a required tensor is missing
INVALID_PARAM = 161002  # dtype, rank, attribute or data value not supported
RUNTIME_ERROR = 361001  # allocation or execution failure
SHAPE_ERROR = 561002  # shapes inconsistent with each other, or empty tensors

CODE_NAMES = {
    NULL_POINTER: "null_pointer",
    INVALID_PARAM: "invalid_param",
    RUNTIME_ERROR: "runtime_error",
    SHAPE_ERROR: "shape_error",
}


class KvcompError(RuntimeError):
    """A kvcomp call was rejected; nothing was written.

    Attributes:
        code: the aclnn status number (161001 null pointer, 161002 invalid
            dtype/rank/attribute/value, 561002 inconsistent shapes or empty
            tensors, 361001 runtime failure).
        code_name: the same as a word ("invalid_param", ...).
        message: one sentence, ``[kvcomp] <parameter> (= <value seen>) must <rule>``.

    It is a RuntimeError, so code that caught the RuntimeError raised by the
    NPU operator keeps working.
    """

    def __init__(self, code, message):
        super().__init__(code, message)
        self.code = int(code)
        self.code_name = CODE_NAMES.get(self.code, "unknown")
        self.message = str(message)

    def __str__(self):
        return f"{self.message} (status {self.code} {self.code_name})"


def error(code, message):
    """A KvcompError whose message is ``[kvcomp] `` + ``message`` (the sentence form of every refusal)."""
    return KvcompError(code, "[kvcomp] " + message)

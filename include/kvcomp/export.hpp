// KVCOMP_API marks what libkvcomp exports. The library is built with hidden
// visibility, so only the public C++ API is part of its ABI; internals can
// change without breaking programs linked against it.
#pragma once

#if defined(_WIN32)
#define KVCOMP_API
#elif defined(__GNUC__)
#define KVCOMP_API __attribute__((visibility("default")))
#else
#define KVCOMP_API
#endif

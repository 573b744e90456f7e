# Sourced by on-device.sh (and tests/scripts): the argument ctest's --stop-time takes for "N seconds from
# now". Only a time of day, HH:MM:SS in local time, works: CMake 4.4's ctest silently ignores the
# "02 Dec 2026 06:50:16 GMT" and "06:50:16 +0000" forms (every test then ran to its own timeout, and the
# call's backstop timeout could kill ctest before its summary). A time of day earlier than now is taken
# as tomorrow, so a stop time past midnight still works.
ctest_stop_time() { date -d "+$1 sec" '+%H:%M:%S'; }

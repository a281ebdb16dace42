#!/bin/bash
# Call 3: call1.sh's commands again, on the pack of 96ef046 (the kernel-compile test comparing
# entry points, 7ad18f7).
exec bash "$(dirname "$0")/call1.sh"

"""A fault-tolerant elastic training runtime (README.md)."""

import os as _os

# gRPC's C core logs a failed TLS handshake (a wrong CA, a missing client certificate) at INFO
# on stderr unless told otherwise, beside the one line that names the problem
# (elastic/coordinator/credentials.py, check_access). Set before anything imports grpc; an explicit
# GRPC_VERBOSITY wins.
_os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

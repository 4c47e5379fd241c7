"""Exit codes of mlxd processes: a contract between the engine, the crash
listener (which classifies exits by them) and the operator scripts."""

OK = 0
USAGE = 64  # bad command line (sysexits EX_USAGE)
NOT_FOUND = 66  # what the command names is not there: a repo not on the hub, a model not in the cache (EX_NOINPUT)
UNAVAILABLE = 69  # refused: a model the engine would not serve, a failed check of `doctor` (EX_UNAVAILABLE)
STARTUP_FAILED = 71  # could not bind the port or start the server (EX_OSERR)
TEMPFAIL = 75  # a transfer failed (offline, a broken connection): running it again resumes (EX_TEMPFAIL)
CONFIG = 78  # invalid config: restarting will not help until it is fixed (EX_CONFIG)
PRELOAD_FAILED = 79  # the default model could not be loaded (not an MLX fault)
MLX_ERROR = 86  # MLX/Metal raised during load or generation: restart me clean

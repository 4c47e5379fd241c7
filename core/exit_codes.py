"""Exit codes of mlxd processes: a contract between the engine, the crash
listener (which classifies exits by them) and the operator scripts."""

OK = 0
USAGE = 64  # bad command line (sysexits EX_USAGE)
STARTUP_FAILED = 71  # could not bind the port or start the server (EX_OSERR)
CONFIG = 78  # invalid config: restarting will not help until it is fixed (EX_CONFIG)
PRELOAD_FAILED = 79  # the default model could not be loaded (not an MLX fault)
MLX_ERROR = 86  # MLX/Metal raised during load or generation: restart me clean

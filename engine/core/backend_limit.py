"""A backend's capability limit met by a forward (an op or dtype it cannot
run: engine/model/errors.py's `backend_limit`): no device fault, so the engine
serves on. The requests running get `backend_unsupported`, the crash journal
a line (no evidence against them: every request fails on the model as
loaded), and the model is reloaded as float32 (once: after that it is
unloaded, and the next request loads it again).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from ..model.errors import EngineError, backend_limit, backend_unsupported
from ..model.events import Failed
from ..model.faults import append_to_journal, backend_limit_record
from ..model.job import Job
from .request_table import running
from .worker_state import Phase

log = logging.getLogger("mlxd.engine.core.worker")


def serve_on_after_limit(core: Any, exc: BaseException, culprit: Job | None = None) -> bool:
    """Whether `exc` was a backend's limit, served on by the core (engine/core/engine_core.py);
    False: an MLX fault, for the core to end the engine on."""
    model_id, limit = core.runner.resident_id, backend_limit(exc)
    if limit is None or model_id is None:
        return False
    reloading = core.registry.serve_as_float32(model_id)
    log.warning("model %s met a limit of its MLX backend: %s; %s", model_id, limit,
                "reloading it as float32" if reloading else "it is float32 already: unloading it")
    error = backend_unsupported(model_id, limit, reloading)
    jobs = [r.job for r in running(core.table.rows())]
    if culprit is not None and culprit not in jobs:
        jobs.append(culprit)
    try:
        append_to_journal(core.registry.journal_path, backend_limit_record(
            time.time(), os.getpid(), model_id, limit, [(j.id, j.fingerprint) for j in jobs], reloading))
    except OSError as exc_journal:  # a full disk must not take the engine down
        log.warning("cannot journal the backend limit: %s", exc_journal)
    for job in jobs:
        job.channel.put(Failed(error))
        core.ledger.release(job.id)
        core.let_go(job, 0.0)
    core.residency.unload()  # the decoders' state is the failed step's: none of it is kept
    core.sync_ledger()
    core.record_inflight()
    if reloading:
        try:
            core.residency.ensure(model_id)
        except EngineError as refusal:  # the next request tries again
            log.warning("reloading %s as float32 failed: %s", model_id, refusal.message)
        except BaseException as fault:  # noqa: BLE001 - an MLX fault in the load: do not limp on
            core.fatal(fault)
            return True
    core.publish(Phase.IDLE)
    return True

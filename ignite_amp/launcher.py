"""Launch a run on every rank: ``torchrun``, spawned processes, or this one process.

A run is distributed when it is started by ``torchrun`` (the environment says so) or when the
config asks for ``distributed.nproc_per_node > 1`` (the processes are then spawned by
``idist.Parallel``). In both cases :func:`launch` runs a function on every rank and returns
rank 0's result; with one process and no ``torchrun`` it simply calls the function.

Ranks of a CPU run stay on the CPU on a machine with GPUs too: Ignite pins rank N to
``cuda:N`` whenever CUDA is visible, so the launcher hides the GPUs from CPU ranks.
"""
import contextlib
import gc
import io
import logging
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from typing import Any, Callable, Iterator, Tuple, Union

import ignite.distributed as idist
import torch
from torch.multiprocessing.spawn import ProcessException

from ignite_amp.config.run_keys import BACKENDS, DistributedConfig  # noqa: F401  (DistributedConfig: its old home)
from ignite_amp.config.tree import Config, load_config
from ignite_amp.core.collectives import adopt_ignite_loggers
from ignite_amp.core.device import is_oom_error, run_device
from ignite_amp.errors import RUN_STOPPED, USER_ERRORS, ConfigError, RankDiedError, first_line
from ignite_amp.files.run_directory import COMMAND_PID, terminal_log_handler

__all__ = ["DistributedConfig", "launch", "under_torchrun", "resolve_backend", "cpu_only"]

def under_torchrun() -> bool:
    """True when this process was started by ``torchrun`` (or another launcher setting its variables)."""
    return all(k in os.environ for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def resolve_backend(backend: str, device: torch.device) -> str:
    """``auto``: NCCL for CUDA, gloo for CPU. Raises ValueError for NCCL without CUDA."""
    if backend not in BACKENDS:
        raise ValueError(f"backend should be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise ValueError(f"nccl needs CUDA devices and this run is on {device}; use gloo")
    return backend


@contextlib.contextmanager
def cpu_only(enabled: bool = True) -> Iterator[None]:
    """Hide the GPUs (``CUDA_VISIBLE_DEVICES=""``) from the ranks started inside, and from this
    process until it first touches CUDA.

    Ignite's native process group calls ``torch.cuda.set_device(local_rank)`` whenever CUDA is
    available, gloo included: on a one-GPU machine rank 1 would die ("invalid device ordinal"),
    and ``idist.device()`` would put CPU ranks on a GPU. Spawned ranks inherit the variable;
    under ``torchrun`` this process is the rank and keeps it. Use it around your own
    ``idist.Parallel(backend="gloo", ...)`` when the ranks should train on the CPU.
    """
    if not enabled:
        yield
        return
    if under_torchrun() and torch.cuda.is_initialized():
        raise ConfigError("device: cpu under torchrun, but this process already initialised CUDA")
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        yield
    finally:
        if not under_torchrun():  # a torchrun rank stays on the CPU for good
            if before is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = before


_RESTART_SCHEME = "ignite-amp-env"


def _restart_rendezvous(url: str, **kwargs: Any) -> Iterator[tuple]:
    """``env://`` with the store's keys under this torchrun restart's own prefix.

    torchrun's agent serves one TCPStore to all its restarts (``--max-restarts``, c10d rendezvous), and
    ``env://`` prefixes nothing per restart: a rank of the next attempt could read the address that a
    killed rank of the previous one had published, and gloo failed ("connectFullMesh failed ...
    Connection refused"), so the first restart died and only the second resumed."""
    store, rank, world_size = next(torch.distributed.rendezvous("env://", **kwargs))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    yield torch.distributed.PrefixStore(f"ignite_amp/attempt_{attempt}", store), rank, world_size


def _restart_scheme() -> str:
    """The URL scheme of :func:`_restart_rendezvous`, registered with torch (Ignite passes a scheme naming
    ``env`` on to ``init_process_group`` as it is)."""
    try:
        torch.distributed.register_rendezvous_handler(_RESTART_SCHEME, _restart_rendezvous)
    except RuntimeError:  # registered by an earlier launch in this process
        pass
    return _RESTART_SCHEME


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _quiet_launchers() -> None:
    """Leave out Ignite's launcher lines and torch's notice that it stops the other processes when
    one failed (the failure itself is reported)."""
    adopt_ignite_loggers()
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)


def _quiet_other_ranks() -> None:
    """Rank 0 prints and logs; the others keep to errors."""
    if idist.get_rank() != 0:
        logging.getLogger().setLevel(logging.ERROR)
        logging.getLogger("ignite_amp").setLevel(logging.ERROR)


def _call(fn: Callable, args: tuple) -> Any:
    try:
        return fn(*args)
    finally:
        # Free the DDP model (held in reference cycles through the engines' handlers) while the
        # process group still exists: freed at interpreter exit instead, gloo aborted now and then
        # ("terminate called without an active exception").
        gc.collect()


def _die_with_parent(parent: int) -> None:
    """Ask Linux to kill this process when its parent dies (``PR_SET_PDEATHSIG``).

    A spawned rank whose launcher was killed (``kill -9``, an out-of-memory killer) would
    otherwise train on as an orphan, hold the run's lock and write its checkpoints: "rerun the
    same command" would then be refused. Elsewhere than Linux this does nothing.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before the request: nothing will send the signal
        os._exit(1)


def _spawned(local_rank: int, fn: Callable, outbox: str, log_level: int, parent: int, args: tuple) -> None:
    """Body of a spawned process: run ``fn``, leave its result or its error for the parent."""
    _die_with_parent(parent)
    signal.signal(signal.SIGINT, _interrupt_once)
    open(os.path.join(outbox, f"started-{os.getpid()}"), "w").close()  # from now on, SIGINT stops it cleanly
    logging.getLogger().addHandler(terminal_log_handler(log_level))
    # As in the CLI's process: a log line that cannot be written (disk full) is not a page of "Logging error".
    logging.raiseExceptions = False
    if isinstance(sys.stdout, io.TextIOWrapper):  # (a spawned process's own stdout is)
        sys.stdout.reconfigure(line_buffering=True)  # rank 0's epoch lines as they come, also through a pipe
    rank = idist.get_rank()
    if "OMP_NUM_THREADS" not in os.environ:  # share the cores, as torchrun does (N x all cores thrashes)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // idist.get_nproc_per_node()))
    _quiet_other_ranks()
    outcome: Tuple[Any, ...]  # ("ok", result) or ("error", exception, traceback)
    try:
        outcome = ("ok", _call(fn, args))
    except BaseException as exc:  # the parent re-raises it; a non-zero exit makes it stop the other ranks
        outcome = ("error", exc, traceback.format_exc())
        _post(outbox, rank, outcome)
        sys.exit(1)
    if rank == 0:
        _post(outbox, rank, outcome)


def _post(outbox: str, rank: int, outcome: tuple) -> None:
    path = os.path.join(outbox, f"rank{rank}.pkl")
    try:
        payload = pickle.dumps(outcome)
    except Exception:  # an unpicklable result or error: send its text
        payload = pickle.dumps(("error", RuntimeError(repr(outcome[1])), outcome[-1]))
    with open(path + ".tmp", "wb") as f:
        f.write(payload)
    os.replace(path + ".tmp", path)


def _collect(outbox: str, nproc: int, died: Any = None) -> Any:
    """Rank 0's result, or the first failure: a rank killed by a signal (``died``, torch's ProcessExitedException:
    what the other ranks raised after it, a closed connection, follows from it), else the first rank's error."""
    if getattr(died, "signal_name", None):
        raise RankDiedError(f"rank {died.error_index} of {nproc} (PID {died.error_pid}) was killed by "
                            f"{died.signal_name} (out of memory, or a kill), and the other ranks were stopped")
    outcomes = {}
    for rank in range(nproc):
        path = os.path.join(outbox, f"rank{rank}.pkl")
        if os.path.exists(path):
            with open(path, "rb") as f:
                outcomes[rank] = pickle.load(f)
    errors = [(rank, o) for rank, o in sorted(outcomes.items()) if o[0] == "error"]
    if errors:
        rank, (_, exc, text) = errors[0]
        if isinstance(exc, USER_ERRORS + RUN_STOPPED + (KeyboardInterrupt,)):
            raise exc
        if is_oom_error(exc):  # the CLI says what to change; the rank's traceback after the first line
            raise torch.OutOfMemoryError(f"rank {rank} of {nproc}: {first_line(exc)}\n{text}")
        # The cause in the first line (the CLI's one line), the rank's traceback after it (train.log, --debug).
        raise RuntimeError(f"rank {rank} of {nproc} failed: {exc.__class__.__name__}: {first_line(exc)}\n{text}")
    if 0 not in outcomes:
        raise RuntimeError(f"the {nproc} training processes ended without a result (killed?)")
    return outcomes[0][1]


def _interrupt_once(signum: int, frame: Any) -> None:
    """A rank's SIGINT: stop as on Ctrl-C; a second one (the terminal's and the launcher's) changes nothing."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


def _stop_ranks(outbox: str, grace: float = 120.0) -> None:
    """Send SIGINT to every spawned rank (each stops as on Ctrl-C), wait for them, kill what remains.

    A rank still starting (importing torch, joining the process group) has nothing to save and would
    print a traceback, or a C++ one, on SIGINT: it is killed quietly instead."""
    import multiprocessing

    if threading.current_thread() is threading.main_thread():
        for number in (signal.SIGINT, signal.SIGTERM):  # stopping already: no second interruption here
            signal.signal(number, signal.SIG_IGN)
    children = multiprocessing.active_children()
    for child in children:
        pid = child.pid
        if pid is None:  # (never: an active child was started)
            continue
        started = os.path.exists(os.path.join(outbox, f"started-{pid}"))
        try:
            os.kill(pid, signal.SIGINT if started else signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace
    for child in children:
        child.join(max(0.0, deadline - time.monotonic()))
        if child.is_alive():
            child.kill()
            child.join(5)


def launch(cfg: Union[Config, dict], fn: Callable, *args: Any) -> Any:
    """Run ``fn(*args)`` on every rank the config (or ``torchrun``) asks for; return rank 0's result.

    - under ``torchrun``: this process is one rank; the process group is set up with
      ``idist.Parallel(backend)`` (``distributed.nproc_per_node`` is then torchrun's business);
    - ``distributed.nproc_per_node: N > 1``: ``idist.Parallel`` spawns N processes on this machine;
    - otherwise ``fn(*args)`` runs here, without a process group.

    Errors raised on a rank are raised here (the first rank's), so a user error stays one line. ``cfg``: a loaded
    config, or a (partial) dict that :func:`~ignite_amp.load_config` reads.
    """
    cfg = load_config(cfg)
    nproc = cfg.distributed.nproc_per_node or 1
    if idist.get_world_size() > 1 or (nproc == 1 and not under_torchrun()):
        return fn(*args)  # already inside a process group, or a plain single-process run
    device = run_device(cfg.device)
    try:
        backend = resolve_backend(cfg.distributed.backend, device)
    except ValueError as exc:
        raise ConfigError(f"distributed.backend: {exc}") from None
    _quiet_launchers()
    if under_torchrun():
        os.environ.setdefault(COMMAND_PID, str(os.getppid()))  # torchrun, which started this rank
        result = []
        with cpu_only(device.type == "cpu"), \
                idist.Parallel(backend=backend, init_method=f"{_restart_scheme()}://") as parallel:
            _quiet_other_ranks()
            parallel.run(lambda local_rank: result.append(_call(fn, args)))
        return result[0]
    if backend == "nccl" and nproc > torch.cuda.device_count():
        raise ConfigError(f"distributed.nproc_per_node: {nproc} processes but {torch.cuda.device_count()} GPUs")
    try:
        pickle.dumps((fn, args))
    except Exception as exc:
        raise ValueError(f"spawning {nproc} processes needs picklable arguments (print_fn=print, not a lambda); "
                         f"{exc}") from None
    outbox = tempfile.mkdtemp(prefix="ignite-amp-")
    before = os.environ.get(COMMAND_PID)
    os.environ[COMMAND_PID] = before or str(os.getpid())  # the ranks' lock names this command, not a rank
    died = None
    try:
        try:
            with cpu_only(device.type == "cpu"), \
                    idist.Parallel(backend=backend, nproc_per_node=nproc, master_port=_free_port()) as parallel:
                parallel.run(_spawned, fn, outbox, logging.getLogger().getEffectiveLevel(), os.getpid(), args)
        except ProcessException as exc:  # a rank failed (and torch stopped the others): its error is in the outbox
            died = exc
        except KeyboardInterrupt:  # Ctrl-C, or a scheduler's SIGTERM to this launcher alone
            _stop_ranks(outbox)
            raise
        return _collect(outbox, nproc, died)
    finally:
        shutil.rmtree(outbox, ignore_errors=True)
        if before is None:
            os.environ.pop(COMMAND_PID, None)

"""Run Python programs as fresh processes, less their start: one interpreter imports what every program's start
would (torch, Ignite, torchvision, TensorBoard, the package and its CLI), then forks a child per program, which
runs it as ``__main__`` (a script by path, or a module as ``python -m`` does) in its own working directory with
its own ``sys.argv`` and its output in files. A child's state is a fresh interpreter's but for the imports, which
are most of a start on 2 cores (about 4 s of the CLI's 5). A child past its time limit is stopped (SIGALRM).

Not for what a fresh process is the point of (a torchrun, a signal to the process group, an environment read at
import): those run with ``subprocess``.
"""
import json
import os
import subprocess
import sys
from typing import List, NamedTuple, Optional

__all__ = ["Forks", "Ran"]

_SERVER = r"""
import json, os, runpy, signal, sys, traceback
import torch, torchvision, ignite, tensorboard, ignite_amp  # nothing runs before the forks but imports
import ignite_amp.cli.main, ignite_amp.run.compose, ignite_amp.handlers
for line in sys.stdin:
    kind, target, argv, cwd, out, err, limit, env = json.loads(line)
    pid = os.fork()
    if pid == 0:
        signal.alarm(limit)
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # the server's stdin holds the requests
        for fd, path in ((1, out), (2, err)):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        code = 0
        try:
            if kind == "script":
                sys.argv, sys.path[0] = [target, *argv], os.path.dirname(os.path.abspath(target))
                runpy.run_path(target, run_name="__main__")
            else:
                sys.argv, sys.path[0] = [target, *argv], cwd
                runpy.run_module(target, run_name="__main__", alter_sys=True)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
            if isinstance(exc.code, str):
                print(exc.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(code)
    print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
"""


class Ran(NamedTuple):
    returncode: int
    stdout: str
    stderr: str


class Forks:
    """``with Forks(folder) as forks: forks.run(["-m", "ignite_amp", "train", ...], cwd)``: the arguments as
    ``python`` takes them (``-m module args`` or ``script.py args``); returns a :class:`Ran`. One at a time.
    ``env``: the server's environment (its ``PYTHONPATH`` makes every program's ``sys.path``); each program's own
    is :meth:`run`'s. The suite shares one server (``tests/conftest.py``'s ``forks`` fixture)."""

    def __init__(self, folder, limit: int = 600, env: Optional[dict] = None):
        self.folder, self.limit, self.count, self.env = str(folder), limit, 0, env
        self.proc: Optional[subprocess.Popen] = None

    def __enter__(self) -> "Forks":
        os.makedirs(self.folder, exist_ok=True)
        self.proc = subprocess.Popen([sys.executable, "-c", _SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, cwd=self.folder, env=self.env)
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def run(self, args: List[str], cwd, env: Optional[dict] = None, limit: Optional[int] = None) -> Ran:
        """``args`` run in ``cwd`` with ``env`` (default: this process's environment now, as ``subprocess``
        gives; ``sys.path`` is the server's, from its ``PYTHONPATH``) for ``limit`` seconds at most."""
        if self.proc is None:
            raise RuntimeError("Forks.run outside its with block")
        kind, target, argv = ("module", args[1], args[2:]) if args[0] == "-m" else ("script", args[0], args[1:])
        self.count += 1
        out, err = (os.path.join(self.folder, f"{self.count}.{s}") for s in ("out", "err"))
        environment = dict(os.environ if env is None else env)
        request = [kind, target, argv, str(cwd), out, err, limit or self.limit, environment]
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the fork server died running {args}")
        with open(out, encoding="utf-8", errors="replace") as o, open(err, encoding="utf-8", errors="replace") as e:
            return Ran(int(line), o.read(), e.read())

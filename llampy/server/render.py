"""Chat templates rendered in worker processes, each render with a time and a memory budget.

A chat template is a program that came with the model file. jinja2's sandbox stops it from reaching out, but not
from looping (`{% for i in range(100000) %}{% for j in range(100000) %}`) or from building huge values, and a
Python thread cannot be stopped from outside. So the server renders in child processes (``python -m
llampy.server.render``): a child's address space is capped (RLIMIT_AS), and a render that spends more CPU time
than its budget kills the child. Either way the request gets a ChatTemplateError (a 400), and the next render gets a fresh
child; the event loop, /health and shutdown never wait on a template.

Protocol over the child's stdin/stdout: frames of a 4-byte little-endian length and UTF-8 JSON. Request:
``{"source", "tool_source", "bos", "eos", "messages", "add_generation_prompt", "tools", "extra"}``; reply:
``{"text": ...}`` or ``{"error": ...}``.
"""
from __future__ import annotations

import asyncio
import json
import os
import select
import struct
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from ..llama.chat import ChatTemplate, ChatTemplateError

RENDER_SECONDS = 3.0        # CPU time of one render (its wall time may reach WALL_FACTOR times that on a busy machine)
WALL_FACTOR = 10.0
RENDER_MEMORY = 1 << 30     # address space of a render process, bytes
N_WORKERS = 2               # render processes at most (renders beyond wait for one)
STARTUP_SECONDS = 30.0      # for a new render process to answer its first message
_HDR = struct.Struct("<I")


class RenderBudgetError(ChatTemplateError):
    """A render ran past its time or memory budget."""


def _frame(obj) -> bytes:
    data = json.dumps(obj).encode()         # ensure_ascii: any string survives the trip
    return _HDR.pack(len(data)) + data


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of process pid (Linux's /proc), or None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


class _Worker:
    def __init__(self, memory: int):
        env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "llampy.server.render", str(memory)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     env=env, close_fds=True)
        self.ready = False                      # answered once: the interpreter and jinja2 have started

    def _read_exact(self, n: int, expired) -> bytes:
        fd, out = self.proc.stdout.fileno(), bytearray()
        while len(out) < n:
            if not select.select([fd], [], [], 0.05)[0]:
                if expired():
                    raise TimeoutError
                continue
            part = os.read(fd, min(n - len(out), 1 << 20))
            if not part:
                raise EOFError
            out += part
        return bytes(out)

    def call(self, request: dict, seconds: float) -> dict:
        """The child's reply to one request; TimeoutError once the child has spent ``seconds`` of CPU time on it
        (a template that loops), or ``WALL_FACTOR`` times that of wall time (a child starved by a loaded machine
        is waited for, not killed at its first seconds: a 400 for a template that was merely slow to get a CPU)."""
        start = time.monotonic()
        cpu0 = _cpu_seconds(self.proc.pid)

        def expired() -> bool:
            wall = time.monotonic() - start
            if wall < seconds:
                return False
            cpu = _cpu_seconds(self.proc.pid) if cpu0 is not None else None
            return cpu is None or cpu - cpu0 >= seconds or wall >= seconds * WALL_FACTOR
        self.proc.stdin.write(_frame(request))
        self.proc.stdin.flush()
        (n,) = _HDR.unpack(self._read_exact(_HDR.size, expired))
        return json.loads(self._read_exact(n, expired))

    def kill(self) -> None:
        try:
            self.proc.kill()
            self.proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            pass


class TemplateRenderer:
    """Renders ChatTemplates in up to ``n_workers`` child processes, each render limited to ``seconds`` of CPU
    time (``_Worker.call``) and ``memory`` bytes of address space. Thread-safe; ``render`` blocks its caller (call it off the event
    loop)."""

    def __init__(self, seconds: float = RENDER_SECONDS, memory: int = RENDER_MEMORY, n_workers: int = N_WORKERS):
        self.seconds, self.memory, self.n_workers = float(seconds), int(memory), max(1, int(n_workers))
        self._idle: list[_Worker] = []
        self._n = 0                             # workers in existence (idle or rendering)
        self._cv = threading.Condition()
        self._closed = False
        # the threads that wait on renders for the event loop: their own, so that a queue of slow renders never
        # holds the threads other off-loop work (grammars, tokenizing) needs
        self._threads = ThreadPoolExecutor(max_workers=self.n_workers + 2, thread_name_prefix="llampy-render")

    def _acquire(self) -> _Worker:
        with self._cv:
            while not self._idle and self._n >= self.n_workers:
                self._cv.wait()
            if self._closed:
                raise ChatTemplateError("the server is shutting down")
            if self._idle:
                return self._idle.pop()
            self._n += 1
        w = None
        try:
            w = _Worker(self.memory)
            w.call({"ping": True}, STARTUP_SECONDS)     # its start-up is not the template's time
            w.ready = True
            return w
        except (OSError, TimeoutError, EOFError, ValueError) as e:
            if w is not None:
                w.kill()
            self._release(None)
            raise ChatTemplateError(f"cannot start a template renderer: {type(e).__name__} {e}") from None

    def _release(self, w: _Worker | None) -> None:
        with self._cv:
            if w is None or self._closed:
                self._n -= 1
                if w is not None:
                    w.kill()
            else:
                self._idle.append(w)
            self._cv.notify()

    def render(self, template: ChatTemplate, messages: list, add_generation_prompt: bool = True, tools=None,
               **extra) -> str:
        """template.render(...) in a child process; ChatTemplateError for what the template raises, and
        RenderBudgetError when it runs out of time or memory."""
        tool = template.tool_use
        req = {"source": template.source, "tool_source": tool.source if tool is not None else None,
               "bos": template.bos_token, "eos": template.eos_token, "messages": messages,
               "add_generation_prompt": add_generation_prompt, "tools": tools, "extra": extra}
        w = self._acquire()
        try:
            reply = w.call(req, self.seconds)
        except TimeoutError:
            w.kill()
            self._release(None)
            raise RenderBudgetError(f"the chat template took longer than {self.seconds:g} s to render") from None
        except (EOFError, OSError, ValueError):     # the child died: out of memory (or killed)
            w.kill()
            self._release(None)
            raise RenderBudgetError(f"the chat template ran out of memory (its budget is "
                                    f"{self.memory >> 20} MiB) or its renderer died") from None
        self._release(w)
        if "error" in reply:
            cls = RenderBudgetError if reply.get("budget") else ChatTemplateError
            raise cls(reply["error"])
        return reply["text"]

    async def run_async(self, fn, *args):
        """fn(*args) (a function that renders through this renderer) in the renderer's waiting threads."""
        return await asyncio.get_running_loop().run_in_executor(self._threads, lambda: fn(*args))

    def warm(self) -> None:
        """Start the workers now (a render's first child takes ~0.1 s to start)."""
        ws = []
        try:
            for _ in range(self.n_workers - len(self._idle)):
                ws.append(self._acquire())
        except ChatTemplateError:
            pass
        for w in ws:
            self._release(w)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            idle, self._idle = self._idle, []
            self._cv.notify_all()
        for w in idle:
            w.kill()
        self._threads.shutdown(wait=False)


def _serve(memory: int) -> None:
    """The child: render requests from stdin until it closes."""
    try:
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        os.nice(10)             # a template that spins for its budget yields the cores to the model
    except (ImportError, ValueError, OSError):
        pass
    parent = os.getppid()

    def orphaned() -> None:     # the server is gone (killed mid-render): a spinning template must not outlive it
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)
    threading.Thread(target=orphaned, daemon=True).start()
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    cache: dict = {}
    while True:
        hdr = inp.read(_HDR.size)
        if len(hdr) < _HDR.size:
            return
        (n,) = _HDR.unpack(hdr)
        try:
            req = json.loads(inp.read(n))
            if req.get("ping"):
                reply = {"text": ""}
            else:
                key = (req["source"], req["tool_source"], req["bos"], req["eos"])
                t = cache.get(key)
                if t is None:
                    tool = (ChatTemplate(req["tool_source"], req["bos"], req["eos"], name="tool_use")
                            if req["tool_source"] else None)
                    t = cache[key] = ChatTemplate(req["source"], req["bos"], req["eos"], tool_use=tool)
                reply = {"text": t.render(req["messages"], req["add_generation_prompt"], req["tools"],
                                          **req["extra"])}
        except ChatTemplateError as e:
            reply = {"error": str(e)}
        except MemoryError:
            reply = {"error": f"the chat template ran out of memory (its budget is {memory >> 20} MiB)",
                     "budget": True}
        try:
            data = _frame(reply)
        except MemoryError:
            data = _frame({"error": "the chat template's output is too large", "budget": True})
        out.write(data)
        out.flush()


if __name__ == "__main__":
    _serve(int(sys.argv[1]) if len(sys.argv) > 1 else RENDER_MEMORY)

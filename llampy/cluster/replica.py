"""The replica deployment: one model and its continuous-batching engine (llampy/server), fed token lists by the
ingress, streaming back the engine's events.

A stream item is a list of events: the first token's event goes at once, later ones are merged when they come
faster than MERGE_S (an item through a Serve handle costs about a millisecond; a decode step is tens). A request
that waits (for a slot, or for its prompt to be decoded) gets an empty item every ``keepalive_s`` of its spec, so
the ingress's idle timeout catches a replica that stopped answering, not a busy one. Every
REPORT_S the replica writes its counters to the board (board.py), which the ingress sums for /health and
/metrics. Its health check fails when the engine thread is dead, or busy without a step for STALL_S.
"""
from __future__ import annotations

import asyncio
import os
import time
import uuid

from ..server.app import Server

MERGE_S = 0.05
KEEPALIVE_S = 1.0       # when the spec names none
REPORT_S = 0.5
STALL_S = 60.0


class TokensServer(Server):
    """The one-process Server without its chat template check: the ingress renders the templates (and checks them
    when it starts); a replica is sent token lists, so it starts no render processes."""

    def _check_template(self) -> None:
        pass


class Replica:
    def __init__(self, model_path: str, n_parallel: int, n_ctx: int, n_threads: int | None = None,
                 pipeline: int = 1, sha256: str | None = None, board: str | None = None):
        from .stage import check_model_file, start_stages
        check_model_file(model_path, sha256)
        offload, self.stages = None, []
        if pipeline > 1:
            offload, self.stages = start_stages(model_path, pipeline, sha256, n_threads)
        self.server = TokensServer(model_path, n_parallel, n_ctx, n_threads=n_threads, offload=offload)
        self.engine = self.server.engine
        self.id = f"{os.uname().nodename}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self._steps, self._t_step = -1, time.monotonic()
        self._board, self.node_id = None, ""
        if board:
            import ray
            self._board = ray.get_actor(board)
            self.node_id = ray.get_runtime_context().get_node_id()
            self._reporter = asyncio.get_event_loop().create_task(self._report_loop())

    # ------------------------------------------------------------------ requests
    async def generate(self, spec: dict):
        """Run one request (a spec from the ingress: tokens, sampling params, the Request's fields; for a resumed
        stream, the tokens generated elsewhere); yield lists of llampy.server.slots.Event."""
        from ..server.app import submit
        from ..server.oai import APIError
        from ..server.slots import Event
        req = await self._request(spec)
        try:
            q = submit(self.server, req)
        except APIError as e:
            yield [Event(finish_reason="error", error=e.message, status=e.status)]
            return
        done, t_last = False, 0.0
        keepalive = spec.get("keepalive_s") or KEEPALIVE_S
        try:
            while not done:
                try:
                    items = [await asyncio.wait_for(q.get(), keepalive)]
                except asyncio.TimeoutError:
                    yield []        # still here: the request waits for a slot or for its prompt
                    continue
                if items[0].error and self.stages and not self._stages_alive():
                    # a stage died under the step: the stream can go on elsewhere (the ingress moves it on 503)
                    # while Serve replaces this replica (check_health fails from now on)
                    items[0].status = 503
                done = items[-1].finish_reason is not None
                # merge what arrives within MERGE_S of the last item (the first one goes at once)
                while not done:
                    wait = t_last + MERGE_S - time.monotonic()
                    if wait <= 0 and q.empty():
                        break
                    try:
                        ev = q.get_nowait() if wait <= 0 else await asyncio.wait_for(q.get(), wait)
                    except asyncio.TimeoutError:
                        break
                    items.append(ev)
                    done = ev.finish_reason is not None
                t_last = time.monotonic()
                yield items
        finally:
            if not done:
                req.cancel()        # the ingress went away, or moved the stream elsewhere

    async def _request(self, spec: dict):
        from ..server.slots import Request
        s = self.server
        grammar = await s.grammar_sampler(spec.get("grammar"))
        sampler = s.sampler(spec["p"], grammar)
        gen = list(spec.get("generated") or [])
        for t in gen:       # a resumed stream: the sampler as it was after these tokens
            sampler.accept(t)
            for smp in sampler.samplers:    # the random draws of one sampled token (XTC's is one float)
                rng = getattr(smp, "rng", None)
                if rng is not None:
                    rng.uniform_float() if type(smp).__name__ == "XTC" else rng.uniform()
        f = spec["fields"]
        return Request(tokens=list(spec["tokens"]) + gen, max_tokens=f["max_tokens"] - len(gen), sampler=sampler,
                       stop=f["stop"], n_probs=f["n_probs"], logprobs=f["logprobs"], ignore_eos=f["ignore_eos"],
                       keep_tokens=frozenset(f["keep_tokens"]), cache_prompt=f["cache_prompt"],
                       id_slot=f["id_slot"], prompt_logprobs=-1 if gen else f["prompt_logprobs"],
                       params=f["params"])

    def _stages_alive(self) -> bool:
        try:
            for st in self.stages:
                st.check()
            return True
        except Exception:
            return False

    # ------------------------------------------------------------------ state
    def stats(self) -> dict:
        e = self.engine
        return {"id": self.id, "pid": os.getpid(), "node_id": self.node_id, "alive": e.alive(),
                "busy": e.busy_slots(), "n_parallel": e.n_parallel, "queue": e.queue_depth(), "kv_used": e.kv_used(),
                "graphs_pending": e.graphs_pending(), "n_ctx": e.n_ctx, "n_ctx_slot": e.n_ctx_slot,
                "tps": e.tokens_per_second(), "metrics": dict(e.metrics), "t": time.time()}

    async def _report_loop(self):
        while True:
            try:
                await self._board.report.remote(self.id, self.stats())
            except Exception:       # the board restarting: report again next time
                pass
            await asyncio.sleep(REPORT_S)

    def check_health(self) -> None:
        """Serve's health check: raise when the engine cannot serve."""
        e = self.engine
        if not e.alive():
            raise RuntimeError("the engine thread stopped")
        steps = e.metrics["steps_total"]
        if steps != self._steps or not e.busy_slots():
            self._steps, self._t_step = steps, time.monotonic()
        elif time.monotonic() - self._t_step > STALL_S:
            raise RuntimeError(f"the engine has been busy without a decode step for {STALL_S:g} s")
        for st in self.stages:
            st.check()

    def __del__(self):
        try:
            self.engine.stop()
        except Exception:
            pass

"""Files larger than one device call's carry (the real models: SmolLM2 94 MiB, Gemma 3 253 MiB) sent to a lent GPU
machine over successive calls, reassembled and checked there, with benchmarks/gpu_check.sh running meanwhile.

A device call takes the working tree plus at most 64 MiB in all; ignored files it leaves on the warm machine stay
there between calls (benchmarks/README.md, "The GPU checks in one device session"). So:

    python benchmarks/gpu_carry.py plan [--models smollm2,gemma3] [--fixtures] [--total 540]     (here)

cuts the files into the calls' folders .gpu-carry/cNN (each piece with its sha256, each folder with the whole
manifest) so that each call's tree plus what it carries stays under the limit (the tree's size is measured: git's
tracked and untracked-not-ignored files), and writes .gpu-carry/calls.md: the exact sequence of device calls
(carry, command, timeout). On the GPU machine, in the repository root:

    python3 benchmarks/gpu_carry.py take .gpu-carry/cNN [--start TOTAL]     a call's pieces into the store
    python3 benchmarks/gpu_carry.py wait OUT [--limit S]                     the check's end; its files into OUT

``take`` checks each piece's sha256 and writes it at its offset into the file it belongs to (in the store,
/tmp/llampy-carry, outside the repository); a file whose pieces are all there is checked whole (sha256) and renamed
to its name (smollm2.gguf, gemma3.gguf); when every file of the manifest is there, the store gets READY. With
``--start`` (the first call) it also copies the repository to /tmp/llampy-run and starts gpu_check.sh there in a
process session of its own, which outlives the call (LLAMPY_REAL_MODELS=the store: its real-model step waits for
READY). Each call prints the check's last lines, so what it did so far comes back even if a later call fails.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CARRY = ".gpu-carry"
LIMIT = 64 << 20                 # a device call's working tree and carried paths together
MARGIN = 3 << 20                 # for the tree growing between the plan and the calls
MAX_CARRY = 8                    # paths per call
# the calls' timeouts: the first 60 s, the others 30 s, the last (pieces, then the check's end) WAIT_S: with a
# machine's start (~120 s) 60 + 7 * 30 + 500 + 120 = 890 s, within a session's 15 minutes of device time
WAIT_S = 500
STORE = Path(os.environ.get("LLAMPY_CARRY_STORE", "/tmp/llampy-carry"))
RUN = Path(os.environ.get("LLAMPY_CARRY_RUN", "/tmp/llampy-run"))   # the repository copy the check runs in,
CHECK_OUT = Path(os.environ.get("LLAMPY_CARRY_OUT", "/tmp/gpu_check"))   # untouched by later calls' trees
# the fixtures tests/cuda/test_cuda_model.py's tiny-model tests read (its MODELS), for --fixtures
TINY_FIXTURES = ["llama-F32", "qwen2-Q8_0", "qwen3-Q8_0", "gemma2-Q8_0", "qwen3moe-Q8_0"]


def sha256(path: Path, offset: int = 0, length: int | None = None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(offset)
        left = os.path.getsize(path) - offset if length is None else length
        while left > 0:
            b = f.read(min(left, 1 << 22))
            if not b:
                break
            h.update(b)
            left -= len(b)
    return h.hexdigest()


# ------------------------------------------------------------------------------------------------ here: the plan

def tree_bytes(root: Path) -> int:
    """What a device call sends besides its carried paths: git's tracked files and untracked files not ignored."""
    out = 0
    for args in (["ls-files", "-z"], ["ls-files", "-z", "-o", "--exclude-standard"]):
        names = subprocess.run(["git", *args], cwd=root, capture_output=True, check=True).stdout.split(b"\0")
        for n in names:
            p = root / os.fsdecode(n)
            if n and p.is_file() and not p.is_symlink():
                out += p.stat().st_size
    return out


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def split(sizes: list[tuple[str, int]], rooms: list[int], room: int) -> list[list[dict]]:
    """Files of the given sizes as one stream cut into calls: call i takes up to rooms[i] bytes (``room`` once the
    list is spent), pieces in order. Each piece: dict(name, offset, length)."""
    calls: list[list[dict]] = []
    free = 0
    for name, size in sizes:
        off = 0
        while off < size:
            if free == 0:
                calls.append([])
                free = rooms[len(calls) - 1] if len(calls) <= len(rooms) else room
                if free <= 0:
                    raise ValueError(f"call {len(calls)} has no room")
            n = min(free, size - off)
            calls[-1].append({"name": name, "offset": off, "length": n})
            off += n
            free -= n
    return calls


def piece_file(name: str, offset: int) -> str:
    return f"{name.replace('/', '__')}.{offset}"


def write_plan(files: list[tuple[str, Path]], out: Path, rooms: list[int], room: int) -> list[Path]:
    """The calls' folders out/c01, c02, ...: each piece as NAME.OFFSET and the manifest (every file's size and
    sha256, every piece's folder, offset, length and sha256)."""
    if out.exists():
        shutil.rmtree(out)
    calls = split([(n, p.stat().st_size) for n, p in files], rooms, room)
    src = dict(files)
    manifest = {"files": [{"name": n, "size": p.stat().st_size, "sha256": sha256(p)} for n, p in files],
                "pieces": []}
    dirs = []
    for i, pieces in enumerate(calls, 1):
        d = out / f"c{i:02d}"
        d.mkdir(parents=True)
        dirs.append(d)
        for pc in pieces:
            with open(src[pc["name"]], "rb") as f:
                f.seek(pc["offset"])
                data = f.read(pc["length"])
            (d / piece_file(pc["name"], pc["offset"])).write_bytes(data)
            manifest["pieces"].append({**pc, "call": d.name, "sha256": hashlib.sha256(data).hexdigest()})
    for d in dirs:
        (d / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return dirs


def real_model_files(names: list[str]) -> list[tuple[str, Path]]:
    sys.path.insert(0, str(ROOT))
    from llampy.models import resolve_model
    return [(f"{n}.gguf", resolve_model(n)) for n in names]


def fixture_files() -> list[tuple[str, Path]]:
    sys.path.insert(0, str(ROOT))
    from tests.paths import TINY
    return [(f"shared/fixtures/tiny/{m}{ext}", TINY / f"{m}{ext}") for m in TINY_FIXTURES for ext in (".gguf", ".json")]


def calls_text(dirs: list[Path], first: list[str], total: int, fixtures: bool, env: list[str]) -> str:
    """The device calls in order, as the tool takes them: carry, timeout_s, command. The first starts the check, the
    last takes its pieces and waits for the check's end."""
    start = f" --start {total}" + (" --fixtures" if fixtures else "") + "".join(f" --env {e}" for e in env)
    wait = f"python3 benchmarks/gpu_carry.py wait $OUT --limit {WAIT_S - 10}"
    lines = []
    for i, d in enumerate(dirs):
        rel = f"{CARRY}/{d.name}"
        carry = (first if i == 0 else []) + [rel]
        cmd = f"python3 benchmarks/gpu_carry.py take {rel}" + (start if i == 0 else "")
        last = i == len(dirs) - 1
        cmd += f"; {wait}" if last else ""
        timeout = WAIT_S if last else 60 if i == 0 else 30
        lines.append(f"{i + 1}. carry {json.dumps(carry)}, timeout_s {timeout}: `{cmd}`")
    lines.append("then give_back.")
    return "\n".join(lines) + "\n"


def cmd_plan(a) -> int:
    files = []
    if a.models:
        files += real_model_files(a.models.split(","))
    if a.fixtures:
        files = fixture_files() + files            # first: step 2 of the check reads them
    tree = tree_bytes(ROOT)
    room = LIMIT - MARGIN - tree
    first = [p for p in a.first if (ROOT / p).exists()]
    first_bytes = sum(dir_bytes(ROOT / p) if (ROOT / p).is_dir() else (ROOT / p).stat().st_size for p in first)
    rooms = [room - first_bytes]
    if room <= 0 or len(first) + 1 > MAX_CARRY:
        print(f"no room: the tree is {tree / 2**20:.1f} MiB", file=sys.stderr)
        return 1
    dirs = write_plan(files, ROOT / CARRY, rooms, room)
    text = calls_text(dirs, first, a.total, a.fixtures, ["TYPES=Q4_K_M"] if a.env is None else a.env)
    (ROOT / CARRY / "calls.md").write_text(text)
    mib = lambda b: f"{b / 2**20:.1f} MiB"       # noqa: E731
    print(f"tree {mib(tree)}; room per call {mib(room)} (first call {mib(rooms[0])} beside {first}); "
          f"{len(files)} files, {mib(sum(p.stat().st_size for _, p in files))}, in {len(dirs)} calls")
    print(text, end="")
    return 0


# ------------------------------------------------------------------------------------------------ there: take, wait

def take(folder: Path, store: Path) -> dict:
    """The pieces of one call's folder written into the store's files; files complete and checked renamed to
    their names; READY once all are. Returns {name: (bytes present, size, state)}; raises on a bad piece."""
    manifest = json.loads((folder / "manifest.json").read_text())
    store.mkdir(parents=True, exist_ok=True)
    state_path = store / "state.json"
    state = json.loads(state_path.read_text()) if state_path.exists() else {}
    sizes = {f["name"]: f for f in manifest["files"]}
    for pc in manifest["pieces"]:
        if pc["call"] != folder.name:
            continue
        src = folder / piece_file(pc["name"], pc["offset"])
        got = sha256(src)
        if got != pc["sha256"] or src.stat().st_size != pc["length"]:
            raise ValueError(f"{src}: sha256 {got} or size {src.stat().st_size} is not the manifest's")
        part = store / (pc["name"] + ".part")
        part.parent.mkdir(parents=True, exist_ok=True)
        if not part.exists():
            with open(part, "wb") as f:
                f.truncate(sizes[pc["name"]]["size"])
        with open(part, "r+b") as f, open(src, "rb") as s:
            f.seek(pc["offset"])
            shutil.copyfileobj(s, f, 1 << 22)
        done = state.setdefault(pc["name"], [])
        if pc["offset"] not in done:
            done.append(pc["offset"])
    report = {}
    for f in manifest["files"]:
        name, final = f["name"], store / f["name"]
        want = [pc["offset"] for pc in manifest["pieces"] if pc["name"] == name]
        have = [o for o in state.get(name, []) if o in want]
        present = sum(pc["length"] for pc in manifest["pieces"] if pc["name"] == name and pc["offset"] in have)
        if final.exists() and final.stat().st_size == f["size"] and state.get(name + ":ok"):
            report[name] = (f["size"], f["size"], "ok")
        elif len(have) == len(want):
            got = sha256(store / (name + ".part"))
            if got != f["sha256"]:
                raise ValueError(f"{name}: whole sha256 {got} is not the manifest's {f['sha256']}")
            os.replace(store / (name + ".part"), final)
            state[name + ":ok"] = True
            report[name] = (f["size"], f["size"], "ok")
        else:
            report[name] = (present, f["size"], f"{len(have)}/{len(want)} pieces")
    state_path.write_text(json.dumps(state))
    if all(r[2] == "ok" for r in report.values()):
        (store / "READY").write_text(json.dumps({n: sizes[n]["sha256"] for n in sizes}))
    return report


def start_check(total: int, store: Path, fixtures: bool, extra: list[str]) -> int:
    """Copy the repository (without the carry folders) to RUN and start gpu_check.sh there in a process session of
    its own; its real-model step reads the store once READY (the fixtures too, with ``fixtures``)."""
    if RUN.exists():
        shutil.rmtree(RUN)
    shutil.copytree(ROOT, RUN, symlinks=True, ignore=shutil.ignore_patterns(CARRY, ".git"))
    CHECK_OUT.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, LLAMPY_REAL_MODELS=str(store))
    env.update(e.split("=", 1) for e in extra)
    if fixtures:
        env["LLAMPY_SHARED"] = str(store / "shared")
    log = open(CHECK_OUT / "run.log", "ab")
    p = subprocess.Popen(["bash", "benchmarks/gpu_check.sh", str(CHECK_OUT), str(total)], cwd=RUN, env=env,
                         stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    (CHECK_OUT / "pid").write_text(str(p.pid))
    return p.pid


def check_tail(n: int = 8) -> str:
    try:
        return "\n".join((CHECK_OUT / "run.log").read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no check running)"


def cmd_take(a) -> int:
    t0 = time.time()
    pid = start_check(a.start, a.store, a.fixtures, a.env) if a.start else None
    if pid:
        print(f"gpu_check.sh started (pid {pid}, {a.start} s) in {RUN}")
    try:
        report = take(Path(a.folder), a.store)
    finally:
        print(f"--- gpu_check so far:\n{check_tail()}")
    for name, (have, size, st) in report.items():
        print(f"{name}: {have / 2**20:.1f} of {size / 2**20:.1f} MiB, {st}")
    print(f"store {a.store}: {'READY' if (a.store / 'READY').exists() else 'incomplete'} ({time.time() - t0:.1f} s)")
    return 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    try:                            # a zombie (its parent was the call that started it) has finished
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return True


def cmd_wait(a) -> int:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    try:
        pid = int((CHECK_OUT / "pid").read_text())
    except (OSError, ValueError):
        pid = None
    while pid and _alive(pid) and time.time() - t0 < a.limit:
        time.sleep(2)
    if pid and _alive(pid):
        print(f"gpu_check.sh still running after {a.limit} s: its files so far")
    shutil.copy(CHECK_OUT / "run.log", out / "run.log") if (CHECK_OUT / "run.log").exists() else None
    with tarfile.open(out / "gpu_check.tgz", "w:gz") as tf:    # one file back: logs and json, no model files
        for p in sorted(CHECK_OUT.rglob("*")):
            if p.is_file() and p.suffix != ".gguf" and p.stat().st_size < (4 << 20):
                tf.add(p, arcname=str(p.relative_to(CHECK_OUT)))
    print(check_tail(40))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("plan", help="cut the files into the calls' folders (here)")
    p.add_argument("--models", default="smollm2,gemma3", help="real models, comma-separated ('' for none)")
    p.add_argument("--fixtures", action="store_true", help="the tiny fixtures test_cuda_model.py reads, first")
    p.add_argument("--first", nargs="*", default=[".llamacpp-src"], help="paths the first call carries too")
    p.add_argument("--total", type=int, default=540, help="gpu_check.sh's seconds, started by the first call")
    p.add_argument("--env", action="append", help="KEY=VALUE for gpu_check.sh (default TYPES=Q4_K_M: the targets' "
                   "type alone)")
    p = sub.add_parser("take", help="a call's pieces into the store (there)")
    p.add_argument("folder")
    p.add_argument("--store", type=Path, default=STORE)
    p.add_argument("--start", type=int, default=0, help="also start gpu_check.sh for this many seconds")
    p.add_argument("--fixtures", action="store_true", help="the check reads the fixtures from the store")
    p.add_argument("--env", action="append", default=[], help="KEY=VALUE for gpu_check.sh")
    p = sub.add_parser("wait", help="wait for gpu_check.sh, then its files into OUT (there)")
    p.add_argument("out")
    p.add_argument("--limit", type=float, default=590)
    a = ap.parse_args(argv)
    return {"plan": cmd_plan, "take": cmd_take, "wait": cmd_wait}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())

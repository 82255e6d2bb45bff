"""``llampy quantize`` (llama-quantize's arguments, over ``llama.quant``) and ``llampy imatrix`` (llama-imatrix's
importance matrix, over ``llama.imatrix``)."""
from __future__ import annotations

import os
import sys
import time


def add_quant_parsers(sub) -> None:
    from .llama.quant import FTYPES
    types = "\n".join(f"  {i:2d}  or  {n:<7s} : {d}" if n != "COPY" else f"          {n:<7s} : {d}"
                      for n, i, _, d in FTYPES)
    p = sub.add_parser("quantize", help="quantize a GGUF model as llama-quantize does",
                       usage="llampy quantize [options] model-f32.gguf [model-quant.gguf] type [nthreads]",
                       epilog="allowed quantization types:\n" + types,
                       formatter_class=__import__("argparse").RawDescriptionHelpFormatter)
    p.add_argument("--allow-requantize", action="store_true", help="allow requantizing already quantized tensors")
    p.add_argument("--leave-output-tensor", action="store_true", help="leave output.weight un(re)quantized")
    p.add_argument("--pure", action="store_true", help="no k-quant mixtures: all tensors to the same type")
    p.add_argument("--imatrix", default=None, help="importance matrix file (GGUF or legacy .dat)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--include-weights", action="append", default=[], help="use the imatrix for these tensors only")
    g.add_argument("--exclude-weights", action="append", default=[], help="do not use the imatrix for these")
    p.add_argument("--output-tensor-type", default=None, help="ggml type for output.weight")
    p.add_argument("--token-embedding-type", default=None, help="ggml type for the token embeddings")
    p.add_argument("--tensor-type", action="append", default=[], help="PATTERN=TYPE (regex searched in the name)")
    p.add_argument("--tensor-type-file", default=None, help="a file of PATTERN=TYPE entries")
    p.add_argument("--override-kv", action="append", default=[], help="KEY=TYPE:VALUE (int, float, bool, str)")
    p.add_argument("--dry-run", action="store_true", help="show the sizes without quantizing")
    p.add_argument("--progress", choices=["auto", "on", "off"], default="auto",
                   help="progress bar on stderr (auto: when stderr is a terminal)")
    p.add_argument("args", nargs="+", metavar="model-f32.gguf [model-quant.gguf] type [nthreads]")
    p.set_defaults(func=cmd_quantize, no_engine=True)

    p = sub.add_parser("imatrix", help="importance matrix for quantization (llama-imatrix's GGUF format)")
    p.add_argument("model", nargs="?", default=None, help="GGUF path, or 'smollm2' (default) / 'gemma3'")
    p.add_argument("-f", "--file", required=True, help="the calibration text")
    p.add_argument("-o", "--output-file", default="imatrix.gguf")
    p.add_argument("-c", "--ctx-size", type=int, default=512)
    p.add_argument("--chunks", type=int, default=None, help="stop after this many chunks")
    p.add_argument("--process-output", action="store_true", help="collect data for output.weight too")
    p.add_argument("--output-format", choices=["gguf", "dat"], default="gguf")
    p.add_argument("-t", "--threads", type=int, default=None)
    p.add_argument("--progress", choices=["auto", "on", "off"], default="auto")
    p.set_defaults(func=cmd_imatrix)


def _parse_override(s: str):
    from .gguf.constants import GGUFValueType as VT
    key, sep, rest = s.partition("=")
    kind, _, val = rest.partition(":")
    if not sep or not key or len(key) >= 128:
        raise ValueError(f"malformed KV override {s!r}")
    if kind == "int":
        return key, abs(int(val)), VT.UINT32
    if kind == "float":
        return key, float(val), VT.FLOAT32
    if kind == "bool" and val in ("true", "false"):
        return key, val == "true", VT.BOOL
    if kind == "str":
        return key, val, VT.STRING
    raise ValueError(f"invalid KV override {s!r}")


def cmd_quantize(args) -> int:
    from .gguf.constants import GGUFValueType as VT
    from .llama.quant import QuantizeError, QuantizeParams, parse_ftype, parse_ggml_type, quantize_model
    pos = list(args.args)
    try:
        params = QuantizeParams(quantize_output_tensor=not args.leave_output_tensor, pure=args.pure,
                                allow_requantize=args.allow_requantize, dry_run=args.dry_run)
        if args.output_tensor_type:
            params.output_tensor_type = parse_ggml_type(args.output_tensor_type)
        if args.token_embedding_type:
            params.token_embedding_type = parse_ggml_type(args.token_embedding_type)
        specs = list(args.tensor_type)
        if args.tensor_type_file:
            with open(args.tensor_type_file, encoding="utf-8") as f:
                specs += f.read().split()
        for spec in specs:
            name, sep, t = spec.partition("=")
            if not sep or not name or not t:
                raise QuantizeError(f"malformed tensor type {spec!r}")
            params.tensor_types.append((name.lower(), parse_ggml_type(t)))
        params.kv_overrides = [_parse_override(s) for s in args.override_kv]
        # positional: IN [OUT] TYPE [NTHREADS], as llama-quantize reads them
        if len(pos) < 2:
            raise QuantizeError("bad arguments: need model-f32.gguf [model-quant.gguf] type [nthreads]")
        fin = pos[0]
        try:
            ftype, fname = parse_ftype(pos[1])
            fout = os.path.join(os.path.dirname(fin), f"ggml-model-{fname}.gguf")
            rest = pos[2:]
        except QuantizeError:
            if len(pos) < 3:
                raise
            fout = pos[1]
            ftype, fname = parse_ftype(pos[2])
            rest = pos[3:]
        if fname == "COPY":
            params.only_copy = True
        params.ftype = ftype
        if rest:
            params.nthread = int(rest[0])
        if args.imatrix:
            from .llama.imatrix import quantize_weights, read_imatrix
            im = read_imatrix(args.imatrix)
            if not im.is_legacy and not im.has_metadata:
                raise QuantizeError(f"missing imatrix metadata in file {args.imatrix}")
            data = quantize_weights(im, args.include_weights, args.exclude_weights)
            if data:
                params.imatrix = data
                params.kv_overrides.append(("quantize.imatrix.file", args.imatrix[:127], VT.STRING))
                if im.datasets:
                    params.kv_overrides.append(("quantize.imatrix.dataset", im.datasets[0][:127], VT.STRING))
                params.kv_overrides.append(("quantize.imatrix.entries_count", len(data), VT.UINT32))
                if im.chunk_count > 0:
                    params.kv_overrides.append(("quantize.imatrix.chunks_count", im.chunk_count, VT.UINT32))
                print(f"loaded {len(data)} importance matrix entries from {args.imatrix} computed on "
                      f"{im.chunk_count} chunks", file=sys.stderr)
    except (QuantizeError, ValueError) as e:
        print(f"llampy: error: {e}", file=sys.stderr)
        return 2
    if params.nthread <= 0:
        params.nthread = os.cpu_count() or 1
    from . import tuning
    if not params.only_copy:            # (a COPY makes no arrays: ctypes is not imported for it)
        tuning.keep_freed_arrays()      # the command's own process: its chunks' temporaries stay mapped
    bar = _bar(args.progress)
    verbose = not bar.on
    print(f"llampy quantize: {'sizing' if params.dry_run else 'quantizing'} '{fin}'"
          + ("" if params.dry_run else f" to '{fout}'") + f" as {fname} using {params.nthread} threads",
          file=sys.stderr)
    try:
        def progress(i, n, name):
            if i == 1:
                tuning.resume_start_up_gc()
            bar.update(i, n, name)
        res = quantize_model(fin, fout, params, log=(lambda s: print(s, file=sys.stderr)) if verbose else None,
                             progress=progress, own_process=args.own_process)
    except (QuantizeError, NotImplementedError) as e:
        bar.close()
        print(f"llampy: error: failed to quantize: {e}", file=sys.stderr)
        return 1
    bar.close()
    mib = 1048576
    print(f"model size  = {res.size_org / mib:8.2f} MiB ({res.size_org * 8 / max(1, res.n_elements):.2f} BPW)",
          file=sys.stderr)
    print(f"quant size  = {res.size_new / mib:8.2f} MiB ({res.size_new * 8 / max(1, res.n_elements):.2f} BPW)",
          file=sys.stderr)
    if res.n_fallback:
        print(f"WARNING: {res.n_fallback} of {len(res.types)} tensor(s) required fallback quantization",
              file=sys.stderr)
    print(f"quantize time = {res.seconds * 1000:10.2f} ms", file=sys.stderr)
    return 0


class _bar:
    """A one-line progress bar on stderr, only when stderr is a terminal (or asked for)."""

    def __init__(self, mode: str):
        self.on = mode == "on" or (mode == "auto" and sys.stderr.isatty())
        self.t0 = time.perf_counter()
        self.drawn = False

    def update(self, i: int, n: int, what: str = "") -> None:
        if not self.on:
            return
        w = 30
        k = w * i // max(1, n)
        sys.stderr.write(f"\r[{'#' * k}{'.' * (w - k)}] {i}/{n} {time.perf_counter() - self.t0:6.1f} s "
                         f"{what[:40]:<40s}")
        sys.stderr.flush()
        self.drawn = True

    def close(self) -> None:
        if self.drawn:
            sys.stderr.write("\n")
            self.drawn = False


def cmd_imatrix(args) -> int:
    from .llama.imatrix import compute_imatrix, write_imatrix, write_imatrix_legacy
    from .llama.model import Model
    from .models import resolve_model
    if args.threads:
        from . import tuning as _tuning
        _tuning.size_numba_pool(args.threads)
    m = Model(resolve_model(args.model), n_threads=args.threads)
    with open(args.file, encoding="utf-8", errors="replace") as f:
        text = f.read()
    bar = _bar(args.progress)
    t0 = time.perf_counter()

    def on_chunk(c, n, ppl):
        if bar.on:
            bar.update(c + 1, n, f"PPL {ppl:.4f}")
        else:
            print(f"[{c + 1}/{n}] {ppl:.4f}", file=sys.stderr, flush=True)
    col, n_chunk, ppl = compute_imatrix(m, text, n_ctx=args.ctx_size, n_chunks=args.chunks,
                                        process_output=args.process_output, on_chunk=on_chunk)
    bar.close()
    im = col.to_imatrix([args.file], n_chunk, args.ctx_size)
    if args.output_format == "dat":
        write_imatrix_legacy(args.output_file, im)
    else:
        write_imatrix(args.output_file, im)
    print(f"Final estimate: PPL = {ppl:.4f}; {len(im.entries)} entries over {n_chunk} chunks written to "
          f"{args.output_file} ({time.perf_counter() - t0:.1f} s)")
    return 0

"""The engine's subcommands: run, chat, tokenize, perplexity, bench. ``llampy.cli`` wires them in."""
from __future__ import annotations

import json
import os
import sys
import time


def _threads(args) -> int | None:
    n = getattr(args, "threads", None)
    if n:
        from . import tuning as _tuning
        _tuning.size_numba_pool(n)
    return n


def add_offload_args(p, default="auto") -> None:
    """llama.cpp's offload flags (``llama.devices``)."""
    p.add_argument("-ngl", "--n-gpu-layers", "--gpu-layers", default=default,
                   help="layers on the GPU: N, 'all', or 'auto' (as many as fit; the default). Without a GPU the "
                        "CPU runs them and a request for layers says so")
    p.add_argument("-sm", "--split-mode", choices=["none", "layer", "row"], default="layer",
                   help="across several GPUs: 'layer' (default), 'row' (each layer matrix's rows split across "
                        "them, the main GPU gathering) or 'none' (the main GPU only)")
    p.add_argument("-ts", "--tensor-split", default=None, help="share of layers (of rows with -sm row) per GPU, "
                   "e.g. 3,1")
    p.add_argument("-mg", "--main-gpu", type=int, default=0)
    p.add_argument("-ot", "--override-tensor", action="append", default=None,
                   help="REGEX=BUFTYPE: weights whose name matches go to CPU, CUDA0, ... (e.g. 'exps=CPU')")


# llama.cpp's -ctk/-ctv values (common/arg.cpp's kv_cache_types)
CACHE_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")


def add_cache_args(p) -> None:
    """llama.cpp's KV-cache type flags."""
    for short, long, what in (("-ctk", "--cache-type-k", "K"), ("-ctv", "--cache-type-v", "V")):
        p.add_argument(short, long, default="f16", type=str.lower, choices=CACHE_TYPES, metavar="TYPE",
                       help=f"the KV cache's {what} type: {', '.join(CACHE_TYPES)} (default f16)")


def cache_kw(args) -> dict:
    """type_k / type_v as GGMLType from -ctk / -ctv."""
    from .ggml.types import GGMLType
    return dict(type_k=GGMLType[getattr(args, "cache_type_k", "f16").upper()],
                type_v=GGMLType[getattr(args, "cache_type_v", "f16").upper()])


def add_mtmd_args(p, image: bool = True) -> None:
    """llama.cpp's multimodal flags (``llampy.mtmd``)."""
    p.add_argument("--mmproj", default=None, metavar="FILE", help="the model's projector GGUF (image input)")
    p.add_argument("--no-mmproj-offload", dest="mmproj_offload", action="store_false",
                   help="encode images on the CPU even when the model has GPU layers (default: on its first GPU)")
    if image:
        p.add_argument("--image", action="append", default=None, metavar="FILE",
                       help="an image for the prompt (repeatable); each goes where the prompt has <__media__>, or "
                            "before the prompt's text when it has none (as llama-mtmd-cli)")


def _mtmd_prompt(llm, prompt: str, paths) -> list:
    """The run's prompt with its images: text tokens and image positions (mtmd chunks, flattened)."""
    from .mtmd import bitmap_from_file
    bitmaps = [bitmap_from_file(p) for p in paths]
    marker = llm.mtmd.media_marker
    if marker not in prompt:          # llama-mtmd-cli's rule: the images before the text
        prompt = marker * len(bitmaps) + prompt
    return llm.mtmd.flatten(llm.mtmd.tokenize(prompt, bitmaps))     # Llama places M-RoPE items by seq_pos


def add_lora_args(p) -> None:
    """llama.cpp's LoRA flags (``llama.lora``)."""
    p.add_argument("--lora", action="append", default=None, metavar="FNAME",
                   help="a GGUF LoRA adapter applied at scale 1 (repeatable)")
    p.add_argument("--lora-scaled", nargs=2, action="append", default=None, metavar=("FNAME", "SCALE"),
                   help="a GGUF LoRA adapter applied at a scale (repeatable)")


def offload_kw(args) -> dict:
    ts = getattr(args, "tensor_split", None)
    ngl = getattr(args, "n_gpu_layers", 0)
    if isinstance(ngl, str) and ngl.strip().lower() == "auto" and not _gpu_wanted():
        ngl = 0
    try:
        split = [float(x) for x in ts.split(",")] if ts else None
    except ValueError:
        from .llama.devices import OffloadError
        raise OffloadError(f"--tensor-split: expected numbers separated by commas, got {ts!r}") from None
    return dict(n_gpu_layers=ngl, split_mode=getattr(args, "split_mode", "layer"), tensor_split=split,
                main_gpu=getattr(args, "main_gpu", 0), override_tensor=getattr(args, "override_tensor", None))


def _gpu_wanted() -> bool:
    from .llama.devices import _gpu_present
    return _gpu_present()


def add_engine_parsers(sub) -> None:
    p = sub.add_parser("run", help="complete a prompt (streams the text)")
    p.add_argument("model", nargs="?", default=None, help="GGUF path, or 'smollm2' (default) / 'gemma3'")
    p.add_argument("-p", "--prompt", required=True)
    p.add_argument("-n", "--n-predict", type=int, default=64)
    p.add_argument("--temp", type=float, default=0.8)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--min-p", type=float, default=0.05)
    p.add_argument("--repeat-penalty", type=float, default=1.0)
    p.add_argument("--n-probs", type=int, default=0, help="top-K log-probs per step (with --json)")
    p.add_argument("-c", "--ctx-size", type=int, default=2048)
    p.add_argument("-t", "--threads", type=int, default=None)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    p.add_argument("--prompt-cache", default=None,
                   help="a file holding the cache of an earlier run: the prompt's common start is not decoded "
                        "again; written after the run (llama-cli's --prompt-cache)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--grammar", default=None, help="a GBNF grammar (llama.cpp's syntax) the output must match")
    g.add_argument("--grammar-file", default=None, help="a file holding a GBNF grammar")
    g.add_argument("-j", "--json-schema", default=None, help="a JSON schema (JSON text) the output must match")
    g.add_argument("-jf", "--json-schema-file", default=None, help="a file holding a JSON schema")
    add_mtmd_args(p)
    add_offload_args(p)
    add_cache_args(p)
    add_lora_args(p)
    from .server.cli import add_spec_args
    add_spec_args(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("chat", help="interactive chat with the model's template (terminal or pipe)")
    p.add_argument("model", nargs="?", default=None)
    p.add_argument("-n", "--n-predict", type=int, default=256)
    p.add_argument("--temp", type=float, default=0.7)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("-s", "--system", default=None, help="system message")
    p.add_argument("--chat-template", default=None, help="a Jinja template, or chatml/llama3/gemma")
    p.add_argument("-c", "--ctx-size", type=int, default=4096)
    p.add_argument("-t", "--threads", type=int, default=None)
    add_mtmd_args(p, image=False)
    add_offload_args(p)
    add_cache_args(p)
    add_lora_args(p)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("warmup", help="compile ahead of time the kernels a model needs (reads its header only)")
    p.add_argument("model", nargs="?", default=None, help="GGUF path, or 'smollm2' (default) / 'gemma3'")
    p.add_argument("--types", default=None,
                   help="comma-separated tensor types (e.g. Q4_K,Q6_K): warm a small llama model in them, no file")
    p.add_argument("-j", "--jobs", type=int, default=2, help="compiling processes (1 or 2; default 2)")
    p.add_argument("--all", action="store_true",
                   help="every batch size: long prompts and a server's parallel decodes too (longer)")
    p.set_defaults(func=cmd_warmup)

    p = sub.add_parser("tokenize", help="print the token ids of TEXT as JSON")
    p.add_argument("model", nargs="?", default=None)
    p.add_argument("text")
    p.add_argument("--no-parse-special", action="store_true")
    p.add_argument("--add-special", action="store_true", help="add BOS/EOS as the vocabulary says")
    p.set_defaults(func=cmd_tokenize)

    p = sub.add_parser("perplexity", help="perplexity of a text file (llama.cpp's method)")
    p.add_argument("model", nargs="?", default=None)
    p.add_argument("-f", "--file", default=None, help="the text (not needed with --kl-divergence)")
    p.add_argument("-c", "--ctx-size", type=int, default=512)
    p.add_argument("--kl-divergence-base", default=None, metavar="FILE",
                   help="alone: save the model's log-probabilities to FILE (llama-perplexity's format); with "
                        "--kl-divergence: compare with those in FILE")
    p.add_argument("--kl-divergence", action="store_true",
                   help="KL divergence, Δp and top-token agreement against --kl-divergence-base")
    p.add_argument("-b", "--batch-size", type=int, default=None)
    p.add_argument("--chunks", type=int, default=None, help="stop after this many chunks")
    p.add_argument("--blas", action="store_true",
                   help="batched products through dequantized weights and BLAS (not llama.cpp's arithmetic; slower "
                        "for the formats with integer kernels)")
    p.add_argument("-t", "--threads", type=int, default=None)
    add_offload_args(p)
    add_cache_args(p)
    add_lora_args(p)
    p.set_defaults(func=cmd_perplexity)

    p = sub.add_parser("bench", help="llama-bench's pp and tg tests")
    p.add_argument("model", nargs="?", default=None)
    p.add_argument("-p", "--n-prompt", type=int, default=512)
    p.add_argument("-n", "--n-gen", type=int, default=128)
    p.add_argument("-t", "--threads", type=int, default=2)
    p.add_argument("-r", "--reps", type=int, default=5)
    p.add_argument("-b", "--batch-size", type=int, default=2048)
    p.add_argument("-ub", "--ubatch-size", type=int, default=512)
    p.add_argument("--json", action="store_true")
    add_offload_args(p)
    add_cache_args(p)
    add_lora_args(p)
    p.set_defaults(func=cmd_bench)


def _lora_pairs(args) -> list:
    """(path, scale) pairs of --lora / --lora-scaled."""
    from .llama.lora import LoraError, parse_lora_args
    try:
        return parse_lora_args(getattr(args, "lora", None), getattr(args, "lora_scaled", None))
    except ValueError:
        raise LoraError(f"--lora-scaled: the scale must be a number, got {args.lora_scaled}") from None


def _lora_adapters(args, model) -> list:
    """--lora / --lora-scaled loaded for ``model``: (LoraAdapter, scale) pairs for Context.set_loras."""
    from .llama.lora import LoraAdapter
    return [(LoraAdapter(model, p), s) for p, s in _lora_pairs(args)]


def _load(args, **kw):
    from .llama.api import Llama
    kv = {k: v.name.lower() for k, v in cache_kw(args).items()}
    return Llama(args.model, n_threads=_threads(args), lora_adapters=_lora_pairs(args), **offload_kw(args), **kv,
                 **kw)


def _grammar(args):
    """The run's constraint from --grammar/--grammar-file/--json-schema/--json-schema-file, or None."""
    from .llama.grammar import GrammarError, LlamaGrammar
    if args.grammar is not None:
        return LlamaGrammar.from_string(args.grammar)
    if args.grammar_file is not None:
        return LlamaGrammar.from_file(args.grammar_file)
    if args.json_schema is not None:
        return LlamaGrammar.from_json_schema(args.json_schema)
    if args.json_schema_file is not None:
        try:
            with open(args.json_schema_file, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise GrammarError(f"cannot read the JSON schema file {args.json_schema_file!r}: {e.strerror or e}") \
                from None
        return LlamaGrammar.from_json_schema(text)
    return None


def cmd_run(args) -> int:
    from .llama.grammar import GrammarError
    try:
        grammar = _grammar(args)         # before loading the model: a bad grammar fails at once
    except GrammarError as e:
        print(f"llampy: error: {e}", file=sys.stderr)
        return 1
    if args.image and not args.mmproj:
        print("llampy: error: --image needs --mmproj (the model's projector GGUF)", file=sys.stderr)
        return 1
    from .llama.speculative import SpeculativeError
    from .server.cli import spec_params
    try:
        spec = spec_params(args)
    except SpeculativeError as e:
        print(f"llampy run: {e}", file=sys.stderr)
        return 2
    llm = _load(args, n_ctx=args.ctx_size, seed=args.seed, mmproj_path=args.mmproj,
                mmproj_offload=args.mmproj_offload)
    try:
        llm.set_speculative(spec, args.model_draft if spec is not None and "draft-simple" in spec.types else None)
    except SpeculativeError as e:
        print(f"llampy: error: {e}", file=sys.stderr)
        return 1
    if args.image:
        tokens = _mtmd_prompt(llm, args.prompt, args.image)
    else:
        tokens = llm.vocab.tokenize(args.prompt, add_special=True, parse_special=True)
    try:
        sampler = llm.make_sampler(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                                   repeat_penalty=args.repeat_penalty, seed=args.seed, grammar=grammar)
    except GrammarError as e:             # what only the vocabulary shows (a token terminal it lacks)
        print(f"llampy: error: {e}", file=sys.stderr)
        return 1
    if args.prompt_cache:
        _load_prompt_cache(llm, args.prompt_cache, tokens)
    steps = llm.generate(tokens, args.n_predict, sampler, n_probs=args.n_probs)
    if args.prompt_cache:       # written once the run is over: the steps are consumed below
        steps = _then(steps, lambda: llm.save_state().save(args.prompt_cache))
    if spec is not None:        # llama-cli's speculative summary, on stderr
        st = llm.spec_stats
        steps = _then(steps, lambda: print(
            f"llampy: speculative: {st['drafted']} tokens drafted, {st['accepted']} accepted"
            + (f" ({st['accepted'] / st['drafted']:.2f})" if st["drafted"] else ""), file=sys.stderr))
    if args.json:
        out = {"prompt_tokens": [t if isinstance(t, int) else -1 for t in tokens], "tokens": [], "text": "",
               "probs": []}
        for s in steps:
            out["tokens"].append(s.token)
            out["text"] += s.text
            out["probs"].append([{"id": i, "logprob": lp} for i, lp in s.top])
        print(json.dumps(out, ensure_ascii=False))
        return 0
    for s in steps:
        sys.stdout.write(s.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def _load_prompt_cache(llm, path, tokens) -> None:
    """Restore a --prompt-cache file, saying on stderr how much of the prompt it holds; a file of another model or
    context size is passed over with a warning."""
    from .llama.context import ContextError
    from .llama.state import LlamaState
    if not os.path.isfile(path):
        return
    try:
        llm.load_state(LlamaState.load(path))
    except ContextError as e:
        print(f"llampy: warning: --prompt-cache {path} not used: {e}", file=sys.stderr)
        return
    n = 0
    for a, b in zip(llm._cached, tokens):
        if a != b:
            break
        n += 1
    print(f"llampy: --prompt-cache: {n} of the prompt's {len(tokens)} tokens reused", file=sys.stderr)


def _then(steps, fn):
    yield from steps
    fn()


def cmd_chat(args) -> int:
    llm = _load(args, n_ctx=args.ctx_size, seed=args.seed, chat_template=args.chat_template, mmproj_path=args.mmproj,
                mmproj_offload=args.mmproj_offload)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    pending: list = []                # image parts added with /image, sent with the next message
    tty = sys.stdin.isatty()
    while True:
        if tty:
            sys.stdout.write("> ")
            sys.stdout.flush()
        line = sys.stdin.readline()
        if not line:
            break
        line = line.rstrip("\n")
        if not line.strip():
            continue
        if line.strip() in ("/exit", "/quit"):
            break
        if line.startswith("/image"):
            part = _image_part(llm, line[len("/image"):].strip())
            if part is not None:
                pending.append(part)
            continue
        if pending:
            messages.append({"role": "user", "content": pending + [{"type": "text", "text": line}]})
            pending = []
        else:
            messages.append({"role": "user", "content": line})
        reply = ""
        for chunk in llm.create_chat_completion(messages, max_tokens=args.n_predict, temperature=args.temp,
                                                seed=args.seed, stream=True):
            piece = chunk["choices"][0]["delta"].get("content", "")
            reply += piece
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        sys.stdout.flush()
        messages.append({"role": "assistant", "content": reply})
    return 0


def _image_part(llm, path: str):
    """The chat REPL's /image PATH: an image_url part holding the file's bytes, or None after saying why."""
    import base64
    if llm.mtmd is None:
        print("llampy: /image needs --mmproj (the model's projector GGUF)", file=sys.stderr)
        return None
    from .mtmd import ImageError, bitmap_from_bytes
    try:
        with open(path, "rb") as f:
            data = f.read()
        bitmap_from_bytes(data)           # refuse what is not an image now, not at the next message
    except OSError as e:
        print(f"llampy: cannot read image {path}: {e.strerror or e}", file=sys.stderr)
        return None
    except ImageError as e:
        print(f"llampy: {path}: {e}", file=sys.stderr)
        return None
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    print(f"llampy: {path} attached to the next message", file=sys.stderr)
    return {"type": "image_url", "image_url": {"url": url}}


def cmd_tokenize(args) -> int:
    from .llama.model import Model
    from .models import resolve_model
    m = Model(resolve_model(args.model), vocab_only=True)
    ids = m.vocab.tokenize(args.text, add_special=args.add_special, parse_special=not args.no_parse_special)
    print(json.dumps({"ids": ids}))
    return 0


def cmd_perplexity(args) -> int:
    from .llama.model import Model
    from .llama.perplexity import perplexity
    from .models import resolve_model
    _threads(args)
    if args.kl_divergence and not args.kl_divergence_base:
        print("llampy: error: --kl-divergence needs --kl-divergence-base FILE", file=sys.stderr)
        return 2
    if not args.kl_divergence and not args.file:
        print("llampy: error: -f/--file is required", file=sys.stderr)
        return 2
    m = Model(resolve_model(args.model), n_threads=args.threads, **offload_kw(args))
    loras = _lora_adapters(args, m)
    if args.kl_divergence:
        return _kl_divergence(m, args, loras)
    with open(args.file, encoding="utf-8", errors="replace") as f:
        text = f.read()
    t0 = time.perf_counter()

    def progress(i, n, ppl):
        print(f"[{i + 1}/{n}] {ppl:.4f}", file=sys.stderr, flush=True)

    writer = None
    if args.kl_divergence_base:
        from .llama.kld import BaseWriter
        vocab = m.vocab
        add_bos = bool(vocab.add_bos and vocab.bos is not None)
        tokens = vocab.tokenize(text, add_special=add_bos, parse_special=False)
        n_chunk = len(tokens) // args.ctx_size
        if args.chunks:
            n_chunk = min(n_chunk, args.chunks)
        writer = BaseWriter(args.kl_divergence_base, args.ctx_size, m.hparams.n_vocab, tokens, n_chunk)
    try:
        res = perplexity(m, text, n_ctx=args.ctx_size, n_batch=args.batch_size, max_chunks=args.chunks,
                         progress=progress, fast=args.blas, on_logits=writer, loras=loras, **cache_kw(args))
    finally:
        if writer:
            writer.close()
    print(f"Final estimate: PPL = {res.ppl:.4f} ({len(res.chunks)} chunks, {res.n_scored} tokens scored, "
          f"{time.perf_counter() - t0:.1f} s)")
    return 0


def _kl_divergence(m, args, loras) -> int:
    from .llama.kld import CHUNK_HEADER, kl_divergence, read_base
    try:
        base = read_base(args.kl_divergence_base)
    except (OSError, ValueError) as e:
        print(f"llampy: error: {e}", file=sys.stderr)
        return 1
    print(CHUNK_HEADER)
    try:
        st = kl_divergence(m, base, n_batch=args.batch_size, max_chunks=args.chunks, fast=args.blas,
                           on_line=lambda s: print(s, flush=True), loras=loras)
    except ValueError as e:
        print(f"llampy: error: {e}", file=sys.stderr)
        return 1
    print()
    summary = st.summary()
    if summary:
        print(summary)
    return 0


def cmd_warmup(args) -> int:
    from .ggml.types import GGMLType
    from .llama.warmup import warmup
    from .models import resolve_model
    if args.jobs not in (1, 2):
        print("llampy: error: --jobs is 1 or 2", file=sys.stderr)
        return 2
    if args.types:
        names = [t.strip().upper() for t in args.types.split(",") if t.strip()]
        bad = [t for t in names if t not in GGMLType.__members__]
        if bad or not names:
            print(f"llampy: error: unknown tensor type(s) {', '.join(bad) or args.types!r}", file=sys.stderr)
            return 2
        try:
            what, r = ", ".join(names), warmup(types=names, jobs=args.jobs, all=args.all)
        except ValueError as e:
            print(f"llampy: error: {e}", file=sys.stderr)
            return 2
    else:
        path = resolve_model(args.model)
        what, r = str(path), warmup(path, jobs=args.jobs, all=args.all)
    print(f"llampy: kernels for {what} ready in {r.seconds:.1f} s ({r.compiled} compiled here, {r.loaded} from the "
          f"cache)")
    return 0


def cmd_bench(args) -> int:
    from .llama.bench import bench
    from .llama.model import Model
    from .models import resolve_model
    _threads(args)
    import numba
    numba.set_num_threads(min(args.threads, numba.config.NUMBA_NUM_THREADS))
    m = Model(resolve_model(args.model), n_threads=args.threads, **offload_kw(args))
    results = bench(m, args.n_prompt, args.n_gen, args.reps, args.batch_size, args.ubatch_size, args.threads,
                    loras=_lora_adapters(args, m), **cache_kw(args))
    if args.json:
        print(json.dumps([r.to_json() for r in results], indent=1))
        return 0
    kv = args.cache_type_k != "f16" or args.cache_type_v != "f16"     # llama-bench adds the columns when set
    print("| model | size | params | backend | ngl | threads |" + (" type_k | type_v |" if kv else "") + " test | t/s |")
    print("| --- | --- | --- | --- | --- | --- |" + (" --- | --- |" if kv else "") + " --- | --- |")
    for r in results:
        print(f"| {m.hparams.arch} {m.hparams.name} | {r.model_size / 2**20:.2f} MiB | {r.model_n_params / 1e6:.2f} M "
              f"| {r.backend} | {r.n_gpu_layers} | {r.n_threads} |"
              + (f" {r.type_k} | {r.type_v} |" if kv else "") + f" {r.test} | {r.avg_ts:.2f} ± {r.stddev_ts:.2f} |")
    return 0

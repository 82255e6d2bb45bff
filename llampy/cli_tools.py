"""The `llampy` commands that make files from files: gguf-split (llama-gguf-split's arguments) and convert
(convert_hf_to_gguf.py's)."""
from __future__ import annotations

import sys


def cmd_gguf_split(args) -> int:
    from .gguf.split import gguf_merge, gguf_split, parse_size
    log = lambda s: print(s, file=sys.stderr)    # noqa: E731
    if args.merge:
        try:
            gguf_merge(args.input, args.output, dry_run=args.dry_run, log=log)
        except FileExistsError as e:
            print(f"llampy: error: {e}", file=sys.stderr)
            return 1
        return 0
    max_size = None
    if args.split_max_size is not None:
        try:
            max_size = parse_size(args.split_max_size)
        except ValueError as e:
            print(f"llampy: error: --split-max-size: {e}", file=sys.stderr)
            return 1
    try:
        gguf_split(args.input, args.output, max_tensors=args.split_max_tensors, max_size=max_size,
                   no_tensor_first_split=args.no_tensor_first_split, dry_run=args.dry_run, log=log)
    except ValueError as e:
        if type(e) is not ValueError:
            raise
        print(f"llampy: error: {e}", file=sys.stderr)
        return 1
    return 0


def cmd_convert(args) -> int:
    from .convert import ConvertError, convert_hf, convert_peft_lora
    log = (lambda s: print(s, file=sys.stderr)) if args.verbose else None
    from .cli_quant import _bar
    bar = _bar("off" if args.verbose else args.progress)
    try:
        if args.lora:
            out = convert_peft_lora(args.model_dir, args.outfile, base=args.base, outtype=args.outtype, log=log)
        else:
            out = convert_hf(args.model_dir, args.outfile, outtype=args.outtype, name=args.name, log=log,
                             progress=bar.update)
    except ConvertError as e:
        bar.close()
        print(f"llampy: error: {e}", file=sys.stderr)
        return 1
    bar.close()
    print(f"llampy convert: wrote {out}", file=sys.stderr)
    return 0


def add_tool_parsers(sub) -> None:
    p = sub.add_parser("gguf-split", help="split a GGUF file in parts or merge the parts (llama-gguf-split)")
    op = p.add_mutually_exclusive_group()
    op.add_argument("--split", action="store_true", help="split GGUF_IN into parts named GGUF_OUT-0000i-of-0000N.gguf "
                                                         "(the default)")
    op.add_argument("--merge", action="store_true", help="merge the parts of GGUF_IN (its first part) into GGUF_OUT")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--split-max-tensors", type=int, default=128, help="max tensors in each part (default 128)")
    mode.add_argument("--split-max-size", default=None, metavar="N(M|G)", help="max size of each part")
    p.add_argument("--no-tensor-first-split", action="store_true", help="the first part holds the metadata only")
    p.add_argument("--dry-run", action="store_true", help="print the plan, write nothing")
    p.add_argument("input", metavar="GGUF_IN")
    p.add_argument("output", metavar="GGUF_OUT")
    p.set_defaults(func=cmd_gguf_split)

    p = sub.add_parser("convert", help="a Hugging Face checkpoint (safetensors, config.json, tokenizer) to GGUF")
    p.add_argument("model_dir", metavar="HF_DIR")
    p.add_argument("outfile", metavar="OUT.gguf")
    p.add_argument("--outtype", choices=["f32", "f16", "bf16", "q8_0"], default="f16",
                   help="type of the matrices (norms and biases stay F32); default f16")
    p.add_argument("--name", default=None, help="general.name (default: the directory's name)")
    p.add_argument("--lora", action="store_true",
                   help="HF_DIR is a PEFT LoRA adapter: write a GGUF LoRA (convert_lora_to_gguf.py)")
    p.add_argument("--base", default=None, metavar="DIR",
                   help="with --lora: the base model's directory (default: the adapter's base_model_name_or_path)")
    p.add_argument("-v", "--verbose", action="store_true", help="one line per tensor")
    p.add_argument("--progress", choices=["auto", "on", "off"], default="auto",
                   help="progress bar on stderr (auto: when stderr is a terminal)")
    p.set_defaults(func=cmd_convert)

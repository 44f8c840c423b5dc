"""`anchor-info FILE` and `anchor-convert IN OUT.safetensors`, as (add_arguments, run) pairs for anima-train.

    info_add_arguments(parser)    / info_run(args) -> int
    convert_add_arguments(parser) / convert_run(args) -> int
`python -m anchor.cli {info,convert} ...` runs them standalone.
"""
import argparse
import json
import sys

from . import AnchorError
from .sites import signature_text


def info_add_arguments(parser):
    parser.add_argument("file", help="an amoe.diffusion.anchor file (.safetensors or .pt, any legacy shape)")
    parser.add_argument("--json", action="store_true", help="print the card and signature as one JSON object")


def info_run(args):
    # lazy: anchor.format imports torch (4.6-7.7 s measured): the CLI parses and prints --help without it
    from .format import load
    try:
        anchor = load(args.file)
        widths = anchor.widths
    except AnchorError as e:
        print(f"anchor-info: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"card": anchor.card(), "widths": widths, "site_names": anchor.site_names}, indent=2))
        return 0
    print(anchor.card_text())
    print(f"  width signature ({len(widths)} sites, training order): {signature_text(widths)}")
    if anchor.site_names:
        print(f"  site names: {anchor.site_names[0]} ... {anchor.site_names[-1]}")
    print("  hash check: " + ("verified (content_hash_v2 matches the tensors)" if anchor.meta.get("content_hash_v2")
                             else "no content_hash_v2 stored, not verified"))
    return 0


def convert_add_arguments(parser):
    parser.add_argument("input", help="anchor to read (.pt of any legacy shape, or .safetensors)")
    parser.add_argument("output", help="the .safetensors file to write (must not exist)")
    parser.add_argument("--key-layout", choices=("amoe", "comfy"), default="amoe",
                        help="amoe = canonical blocks.{site}.{param} (default); comfy = export layout keyed by "
                             "site name (needs substrate.site_names)")


def convert_run(args):
    # lazy: see info_run
    from .format import load, save
    if not str(args.output).endswith(".safetensors"):
        print(f"anchor-convert: {args.output}: the output name must end in .safetensors", file=sys.stderr)
        return 2
    try:
        anchor = load(args.input)
        chash = save(anchor, args.output, key_layout=args.key_layout, overwrite=False)
    except FileExistsError:  # also when it appeared while converting: never replaced
        print(f"anchor-convert: {args.output} already exists; give a new output name, or move that file away first "
              "(nothing was written)", file=sys.stderr)
        return 2
    except AnchorError as e:
        print(f"anchor-convert: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.output} ({anchor.kind}, {anchor.n_sites} sites, {chash})")
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m anchor.cli")
    sub = parser.add_subparsers(dest="command", required=True)
    info_add_arguments(sub.add_parser("info", help="print an anchor's card and width signature"))
    convert_add_arguments(sub.add_parser("convert", help="convert an anchor to .safetensors"))
    args = parser.parse_args(argv)
    return info_run(args) if args.command == "info" else convert_run(args)


if __name__ == "__main__":
    sys.exit(main())

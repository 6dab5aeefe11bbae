"""Where a switch's loss on CoQA comes from: the switch benchmark's CoQA dev items (the history: exemplar
conversations, then the item's own passage; its earlier turns read after it), the 0.5B's cache of them mapped for the
1.5B (no recompute), and the same cache with one region's K/V replaced by the 1.5B's own at every layer — the
exemplars' passages, the exemplars' question/answer turns, the item's passage, the item's earlier turns — or with the
1.5B's own K/V in its first 7 or 14 layers everywhere. Per variant: the KL of the first answer token to the 1.5B
alone, greedy answer F1 and agreement with the 1.5B alone. Also the share of the 1.5B's attention (its question's
queries, target alone) that each region receives, per third of its layers.

With --picks POLICY,... only the 0.5B runs: per item and recompute policy, where its picks land (the share of the
picked positions in each region, and the share of the item's passage picked), the exact prefix the mapper's; a
`turn_attention` policy with a lookahead ranks by the 0.5B's attention over the question and its greedy answer;
`target_turn_attention` by the 1.5B's over the question on the mapped cache (the 1.5B runs too).

Usage: .venv/bin/python experiments/switch_regions.py ITEMS OUT.json  (e.g. 12 runs/switch_regions.json)
       .venv/bin/python experiments/switch_regions.py ITEMS OUT.json --picks turn_attention:5%,recent:10%
"""

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import torch

from kvhandoff.model.cache import cache_copy, prefill, rollback
from kvhandoff.model.geometry import decoder_layers
from kvhandoff.model.rope import apply_rope, rope_frequencies
from kvhandoff.runtime.handoff import handoff_cache
from kvhandoff.runtime.plan import HandoffPlan
from kvhandoff.runtime.policy import SelectionInfo, TargetTurnAttention, parse
from kvhandoff.runtime.recompute import record_queries, turn_attention_scores
from kvhandoff.workflow import load_named_pair, obtain_mapper
from kvhandoff_lab.evaluation.metrics import max_f1, normalise_text
from kvhandoff_lab.evaluation.switch import answer_on, first_token_kl, turn_items
from kvhandoff_lab.evaluation.switchtasks import COQA_HEADER, get_switch_task

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("items", type=int, help="CoQA dev items (4 turns of each story, 8 history slots)")
parser.add_argument("out", help="JSON written after every item")
parser.add_argument("--threads", type=int, default=2)
parser.add_argument("--picks", help="comma list of recompute policies: only where their picks land")
args = parser.parse_args()
torch.set_num_threads(args.threads)
pair = load_named_pair("qwen2.5-coder:0.5b", "qwen2.5-coder:1.5b")
source, target, tokenizer = pair.source, pair.target, pair.tokenizer
mapper, _, _ = obtain_mapper(pair)
task = get_switch_task("coqa_gen")
exemplar_text = {e.id: e.text for e in task.exemplars()}
base_of = {i.id: i.base for i in task.items()}
items = turn_items("coqa_gen", tokenizer, limit=args.items, pool="dev")
layers = len(decoder_layers(target))
REGIONS = ("exemplar passages", "exemplar turns", "item passage", "item turns")


def regions_of(item) -> torch.Tensor:
    """The region index (into `REGIONS`, -1: the header) of every history + extension position."""
    text = COQA_HEADER
    spans = []  # (start char, end char, region)
    for exemplar in item.history.exemplars:
        body = exemplar_text[exemplar]
        split = body.index("Question: ")
        spans += [(len(text), len(text) + split, 0), (len(text) + split, len(text) + len(body), 1)]
        text += body
    spans.append((len(text), 10**9, 2))
    encoded = tokenizer(text + base_of[item.id], return_offsets_mapping=True)
    if tuple(encoded["input_ids"]) != item.history.ids:
        raise SystemExit(f"{item.id}: the history's tokens differ from its text's; regions cannot be placed")
    region = torch.full((len(item.history.ids) + len(item.extension),), -1)
    for position, (start, _end) in enumerate(encoded["offset_mapping"]):
        region[position] = next((r for a, b, r in spans if a <= start < b), -1)
    region[len(item.history.ids):] = 3
    return region


@torch.inference_mode()
def attention_shares(cache, question, region) -> list[list[float]]:
    """Per third of the target's layers, the share of its question's attention (heads and queries averaged) each
    region receives over the cached positions."""
    total = cache.get_seq_length()
    with record_queries(target, len(question)) as queries:
        prefill(target, torch.tensor([list(question)]), cache)
    inv_freq, scaling = rope_frequencies(target.config, seq_len=total + len(question))
    per_layer = []
    for layer, q, cached in zip(decoder_layers(target), queries, cache.layers, strict=True):
        at = torch.arange(total, total + len(question))
        q = apply_rope(q, at, inv_freq, scaling).float()
        keys = cached.keys.float().repeat_interleave(q.shape[1] // cached.keys.shape[1], dim=1)
        logits = (q @ keys.transpose(2, 3)) * layer.self_attn.scaling
        logits = logits.masked_fill(torch.arange(keys.shape[2]) > at[:, None], float("-inf"))
        weights = logits.softmax(-1)[..., :total].mean(dim=(0, 1, 2))  # what the question's own positions get: out
        per_layer.append([float(weights[: len(region)][region == r].sum()) for r in range(len(REGIONS))])
    rollback(cache, total)
    thirds = [per_layer[i * layers // 3:(i + 1) * layers // 3] for i in range(3)]
    return [[sum(row[r] for row in third) / len(third) for r in range(len(REGIONS))] for third in thirds]


def picks_landing(item, region, policies) -> dict:
    """Per policy: the share of its picks in each region and the share of each region picked."""
    ids = torch.tensor([list(item.history.ids) + list(item.extension)])
    source_cache, _ = prefill(source, ids)
    question = torch.tensor([list(item.question)])
    scores = {lookahead: turn_attention_scores(source, source_cache, question, lookahead)
              for lookahead in sorted({getattr(policy, "lookahead", 0) for policy in policies
                                       if not isinstance(policy, TargetTurnAttention)})}
    mapped = handoff_cache(source, target, mapper, ids, HandoffPlan.of(recompute="none"), source_cache) if any(
        isinstance(policy, TargetTurnAttention) for policy in policies) else None
    landing = {}
    for policy in policies:
        info = SelectionInfo(start=mapper.exact_prefix, new_turn=tuple(item.question))
        if not isinstance(policy, TargetTurnAttention):
            info = replace(info, source_attention=scores[getattr(policy, "lookahead", 0)])
        picked = region[policy.positions(target, mapped, ids, info)[0]]
        landing[policy.spec] = {
            "picked": int(picked.numel()),
            "share_of_picks": {name: float((picked == r).float().mean()) for r, name in enumerate(REGIONS)},
            "share_of_region": {name: float((picked == r).sum() / max(1, int((region == r).sum())))
                                for r, name in enumerate(REGIONS)}}
    return landing


rows = []
started = time.monotonic()
if args.picks:
    policies = [parse(spec) for spec in args.picks.split(",")]
    for item in items:
        region = regions_of(item)
        rows.append({"id": item.id, "tokens": len(region), "region_tokens": {
            name: int((region == i).sum()) for i, name in enumerate(REGIONS)},
            "picks": picks_landing(item, region, policies)})
        Path(args.out).write_text(json.dumps({"regions": list(REGIONS), "items": rows,
                                              "seconds": time.monotonic() - started}, indent=1))
        print(item.id, {spec: round(v["share_of_region"]["item passage"], 2)
                        for spec, v in rows[-1]["picks"].items()}, flush=True)
    raise SystemExit(0)
for item in items:
    ids = torch.tensor([list(item.history.ids) + list(item.extension)])
    region = regions_of(item)
    own, _ = prefill(target, ids)
    source_cache, _ = prefill(source, ids)
    mapped = handoff_cache(source, target, mapper, ids, HandoffPlan.of(recompute="none"),
                           source_cache=cache_copy(source_cache))
    reference_text, _, reference_first = answer_on(target, own, item.question, tokenizer, 32, task.stop)
    variants = {"mapped (no recompute)": mapped}
    for index, name in enumerate(REGIONS):
        patched = cache_copy(mapped)
        where = (region == index).nonzero().flatten()
        for mine, theirs in zip(patched.layers, own.layers, strict=True):
            mine.keys[:, :, where] = theirs.keys[:, :, where]
            mine.values[:, :, where] = theirs.values[:, :, where]
        variants[f"{name} exact"] = patched
    for count in (7, 14):
        patched = cache_copy(mapped)
        for mine, theirs in zip(patched.layers[:count], own.layers[:count], strict=True):
            mine.keys.copy_(theirs.keys)
            mine.values.copy_(theirs.values)
        variants[f"first {count} layers exact"] = patched
    row = {"id": item.id, "tokens": int(ids.shape[1]), "answers": list(item.answers),
           "target_alone": {"output": reference_text, "f1": max_f1(reference_text, item.answers)},
           "region_tokens": {name: int((region == i).sum()) for i, name in enumerate(REGIONS)},
           "attention_target_alone": attention_shares(own, item.question, region),
           "attention_mapped": attention_shares(mapped, item.question, region), "variants": {}}
    for name, cache in variants.items():
        text, _, first = answer_on(target, cache, item.question, tokenizer, 32, task.stop)
        row["variants"][name] = {"output": text, "f1": max_f1(text, item.answers),
                                 "same_answer": normalise_text(text) == normalise_text(reference_text),
                                 "first_token_kl": first_token_kl(reference_first, first)}
    rows.append(row)
    Path(args.out).write_text(json.dumps({"regions": list(REGIONS), "items": rows,
                                          "seconds": time.monotonic() - started}, indent=1))
    print(item.id, {k: round(v["first_token_kl"], 2) for k, v in row["variants"].items()}, flush=True)

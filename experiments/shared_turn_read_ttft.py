"""What a relative guard signal costs at a switch under each pair's recorded recompute policy, when the previous
model's read of the new turn is made twice (once for the guard's reference, once for `turn_attention`'s ranking)
and when it is made once (`SwitchingSession.preview_turn` handing its attention to the handover, as the server
does); beside the switch with no guard and the target's re-prefill.

    python experiments/shared_turn_read_ttft.py OUT_JSON [HISTORY_TOKENS] [REPEATS] [THREADS]

The default pair's cached mappers (each direction under the policy its manifest records); a history of
HISTORY_TOKENS (default 2048) tokens of CoQA stories read by the source, then a 16-token question handed to the
target; per direction the four paths interleaved, one warm-up round and REPEATS (default 3) timed rounds, medians.
Each path starts from a copy of the source's history cache (the source's prefill is not timed).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from kvhandoff.model.cache import prefill
from kvhandoff.model.loading import DEFAULT_SOURCE, DEFAULT_TARGET
from kvhandoff.runtime.plan import DEFAULT_PLAN, recorded_policy, recorded_recompute
from kvhandoff.runtime.seam import new_cache
from kvhandoff.runtime.session import SwitchingSession
from kvhandoff.runtime.switch.guard import DEFAULT_GUARD_WINDOW
from kvhandoff.workflow import load_named_pair, obtain_mapper
from kvhandoff_lab.serving.workload import coqa_dialogues, document

QUESTION = "Question: Who was the first person in the story to leave the house, and why?\nAnswer:"


def switch_paths(session_of, question: list[int], window: int) -> dict:
    """The timed work of each path, on a fresh session holding the source's history (``session_of()``)."""

    def plain():
        session_of().read_logprobs("target", question)

    def twice():
        session = session_of()
        session.preview_turn("target", question, window, attention=False)
        session.read_logprobs("target", question, window)

    def once():
        session = session_of()
        _, attention = session.preview_turn("target", question, window)
        session.read_logprobs("target", question, window, source_turn_read=attention)

    return {"switch": plain, "switch + reference, read twice": twice, "switch + reference, read once": once}


def direction(pair, history: list[int], question: list[int], repeats: int) -> dict:
    mapper, _, _ = obtain_mapper(pair)
    policy = recorded_policy(recorded_recompute(mapper)) or DEFAULT_PLAN.recompute
    plan = DEFAULT_PLAN.with_recompute(policy)
    held = new_cache(pair.source)
    with torch.inference_mode():
        held.read(pair.source, torch.tensor([history]))

    def session_of() -> SwitchingSession:
        session = SwitchingSession({"source": pair.source, "target": pair.target},
                                   {("source", "target"): mapper}, plan=plan)
        session.restore(history, {"source": (held.copy(), len(history))}, "source")
        return session

    everything = torch.tensor([history + question])
    paths = {"reprefill": lambda: prefill(pair.target, everything),
             **switch_paths(session_of, question, DEFAULT_GUARD_WINDOW)}
    times: dict[str, list[float]] = {name: [] for name in paths}
    with torch.inference_mode():
        for round_ in range(1 + repeats):
            for name, work in paths.items():
                start = time.perf_counter()
                work()
                if round_:
                    times[name].append(time.perf_counter() - start)
    medians = {name: float(np.median(values)) for name, values in times.items()}
    return {"source": pair.source_spec, "target": pair.target_spec, "recompute": policy.spec,
            "seconds": medians, "samples": times,
            "speedup": {name: medians["reprefill"] / s for name, s in medians.items() if name != "reprefill"}}


def main(out: str, history_tokens: str = "2048", repeats: str = "3", threads: str = "2") -> None:
    torch.set_num_threads(int(threads))
    pair = load_named_pair(DEFAULT_SOURCE, DEFAULT_TARGET)
    tokenizer = pair.tokenizer
    history = tokenizer(document(tokenizer, int(history_tokens), coqa_dialogues()),
                        add_special_tokens=False)["input_ids"][: int(history_tokens)]
    question = tokenizer(QUESTION, add_special_tokens=False)["input_ids"]
    result = {"history_tokens": len(history), "question_tokens": len(question), "threads": int(threads),
              "repeats": int(repeats), "directions": []}
    for named in (pair, pair.reversed()):
        row = direction(named, history, question, int(repeats))
        result["directions"].append(row)
        print(f"{row['source']} → {row['target']} ({row['recompute']}): " + ", ".join(
            f"{name} {seconds:.2f} s" for name, seconds in row["seconds"].items()))
    Path(out).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    main(*sys.argv[1:])

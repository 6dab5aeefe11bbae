"""The switch: how a turn is served on a model when another model of the family served the conversation last.

The contract, one module a step:

- `pair` — deciding: `SwitchSettings` (what a front end's user says of every pair, validated once) resolves into
  each ordered pair's `PairPolicy` (`pair_policies`): the `HandoffPlan` its sessions hand over by, where its
  recompute policy came from (`ServedRecompute`: named, recorded with the mapper, re-chosen from the recorded
  trade-off, or the default) and its quality guard, limited by what the pair's backends can do
  (`kvhandoff.runtime.seam.Capabilities`).
- `guard` — judging: the guard's signals and scores (`guard_score`), its `GuardPolicy` and its actions
  (`Fallback`, `Escalate`).
- `turn` — serving: `serve_turn` brings a model's cache of a `SwitchingSession` up to a prompt under the pair
  policies and reports what happened (`TurnReport`); moving the bytes is the session's and the cache seam's.

Front ends (the HTTP server, a vLLM connector, a script) import these; nothing here imports a front end.
"""

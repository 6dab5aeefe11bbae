"""kvhandoff inside vLLM: a KV connector (`kvhandoff.vllm.connector.KVHandoffConnector`) that stores each model's
own K/V of full-block prefixes in a Valkey/Redis store (`kvhandoff.vllm.store`) and loads them into another
instance — as they are for the same model, mapped by the pair's `Mapper` for another model of the family.

Only `kvhandoff.vllm.connector` imports vLLM (it runs inside vLLM's processes); the other modules import without it.
"""

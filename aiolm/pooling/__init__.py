"""Pooling models: embeddings, reranking and classification behind the same engine.

torch-free: ``params`` (what a request asks for), ``config`` (how a model pools, read from
its folder) and ``scores`` (activations and similarities applied to what the workers
return) are read by the engine process; ``poolers`` (hidden states -> one vector per
request) runs in the workers.
"""

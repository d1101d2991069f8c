"""Core: the canonical layer, layout v1 (the numpy spec of the packed format) and dtype helpers.

Pure numpy: nothing here imports compiled code. Native twins register themselves as fast paths
(``fastpath``) from ``w4pack.native``; the numpy code stays the fallback and the spec.
"""

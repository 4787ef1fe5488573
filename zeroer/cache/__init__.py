"""KV-cache geometry: specs, guarded buffers, typed layer views, the segment table, named presets."""

from zeroer.cache.geometries import GEOMETRIES, LARGE_GEOMETRIES, geometry, geometry_names
from zeroer.cache.layout import (GUARD_WORD, POISON_WORD, WORD_BYTES, CacheSpec, KVCache, Segment, SegmentTable,
                                 TensorSpec, build_cache, device_index)

__all__ = [
    "GEOMETRIES", "GUARD_WORD", "LARGE_GEOMETRIES", "POISON_WORD", "WORD_BYTES", "CacheSpec", "KVCache",
    "Segment", "SegmentTable", "TensorSpec", "build_cache", "device_index", "geometry", "geometry_names",
]

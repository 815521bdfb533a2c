"""Out-of-memory: parse any OOM message, capture the allocator at the failure, diagnose it, and the panel."""

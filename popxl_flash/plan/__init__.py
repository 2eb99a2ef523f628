"""Host-side planning, numpy only: options and validation (`config`, `score_mods`,
`segments`), the block schedule (`schedule`, the compiled planner), loop steps (`steps`), the
cost model and chunk choice (`costmodel`), the KV-cache and context-parallel plans
(`kvcache`, `context_parallel`). Nothing here imports PopXL."""

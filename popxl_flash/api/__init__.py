"""The public entry points, thin over `graph` and `plan`: the functional API (`functional`),
flash-attn's names (`flash_attn_interface`, `varlen`), the KV cache (`kvcache`), context
parallelism (`context_parallel`, `context_parallel_graphs`), autodiff (`autodiff`,
`provenance`), `explain`, `fpchecks` and the layers' graph logic under the popxl-addons
modules (`layers`)."""

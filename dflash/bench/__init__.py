"""The benchmarks: every cost ratio of the evaluator measured in one run (`suite`, `python -m dflash.bench` /
`dflash-bench`), the users' 27B shape stage by stage (`scale`, `steady`, and the floors that bound it: `floors`),
and decoding speed (`speed`: the engine against transformers, the online loop against target-only decoding).
Figures are printed, never asserted."""

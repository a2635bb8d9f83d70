"""Pass infrastructure: what a pass is, how pipelines are written, built and run.

- `base`: `Pass`, `function_pass`, options, `PassContext`, graph properties.
- `pipeline_syntax`: pipeline text and YAML read into `PassSpec`s and written
  back; `PipelineError`.
- `registry`: passes and presets by name, plugins, the `ernie-ir passes` listing.
- `pipeline`: `Pipeline`, validated against the registry (`build_pipeline`,
  `load_pipeline`).
- `manager`: `PassManager` and `run_pipeline`: runs a pipeline, verifying as it goes.
- `instruments`: timing, IR printing, dumps, rewrite counts.
- `rewrite`: declarative rules (pattern / check / rewrite), rule sets, the tracer.
- `dataflow_rule`: rules that find their match by walking the dataflow.
- `param_placer`: where the params a pass creates are listed.

Nothing here imports a pass family; the families import this.
"""

"""Miles integration: the init hook's work, the Miles shapes it binds to, and resume with the same command.

`install` (phases of the hook) <- `config` (plugin settings), `shapes` (known Miles versions),
`bindings` (rebinding plan), `single_lora` (the replacements), `resume` (save root, Megatron
tracker, base load), `runtime` (per-process state), `startup` (checks before training).
Nothing here imports Miles at module level: the hook imports whatever Miles runs it.
"""

"""From (document, cursor) to a prompt, and from the model's text back to what is safe to insert.

Three rooms, in the order the data flows and with imports pointing one way
(``prompt`` -> ``cut`` -> ``source``; none of them imports ``lsp`` or ``engine``):

- :mod:`context.source`: source code as ember reads it: documents with their tree-sitter trees,
  languages, definitions, the workspace index and import resolution.
- :mod:`context.cut`: the model's answer cut and cleaned for insertion (post-processing, brackets,
  line and suffix rules, control tokens).
- :mod:`context.prompt`: the completion site, windows, FIM templates, cross-file context
  (open-file snippets and workspace retrieval), prompt building, and the strategies that pair a
  prompt builder with a cutter.
"""

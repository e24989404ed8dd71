"""Source code as ember reads it; nothing here knows about prompts or models.

- :mod:`.document`: ``Document``, an open document's text and tree-sitter tree, kept in sync with
  edits; :mod:`.memo`: ``TextMemo``, what is derived from the text and survives edits elsewhere.
- :mod:`.languages`: language ids, grammars, and ``LanguageInfo``, each language's lexical facts.
- :mod:`.definitions`: a file's top-level definitions (``definitions``) and imports
  (``python_imports``, ``js_imports``, ``module_keys``).
- :mod:`.workspace`: ``WorkspaceIndex``, the files under the editor's workspace folders and their
  summaries; :mod:`.file_rules`: which files are source (ignores, binaries, virtualenvs).
- :mod:`.imports`: ``resolve_imports``, from a file's imports to the workspace files that define them.
"""

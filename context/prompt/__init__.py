"""From a cursor to the prompt the engine gets, and the cutter for its answer; reads
:mod:`context.source` and :mod:`context.cut`.

- :mod:`.site`: ``CompletionSite`` (``site_at``), everything later steps read about the cursor.
- :mod:`.builder`: ``build_prompt`` / ``anchored_prompt``, ``Prompt``, ``PromptBudget``,
  ``PrefixKey``; :mod:`.window`: the anchored window and token counts; :mod:`.fim`: templates.
- :mod:`.snippets`: ``CrossFile`` and ``Snippet`` (the cross-file block), ``select_snippets``
  (from open documents) and the block's rendering; :mod:`.retrieval`: ``workspace_context``
  (from the workspace index).
- :mod:`.strategy`: ``Strategy``, a prompt builder paired with a cutter, and the baselines.
"""

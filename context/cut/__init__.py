"""The model's answer, cut where the author's code ends and cleaned for insertion; reads
:mod:`context.source` (languages, parsers) only.

- :mod:`.postprocess`: the public functions (``completion_mode``, ``find_stop``, ``postprocess``,
  ``syntax_ok``) and ``SyntaxCutter``, the streaming cutter.
- :mod:`.surroundings`: ``Surroundings``, the summary of the cursor's surroundings the rules read.
- :mod:`.line_rules` (which lines to keep), :mod:`.suffix_rules` (a block against the code after
  the cursor), :mod:`.brackets` (brackets, overlap, parse checks), :mod:`.chat` (chat after code).
- :mod:`.control_tokens`: ``strip_control_tokens``, FIM/chat markers out of the model's text.
- :mod:`.confidence`: ``judge``, what to show of an answer given the model's token
  log-probabilities (hidden when unsure, a block shortened, degenerate repetition never shown).
"""

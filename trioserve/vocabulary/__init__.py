"""The request vocabulary: what a client may ask of a generation and what it
gets back, declared once, with neither torch nor trio beneath it.

Both wire formats (:mod:`trioserve.protocol`, the WebSocket protocol, and
:mod:`trioserve.openai`, the OpenAI API) derive their codecs from it, and the
engines read the same declarations:

- :mod:`.request`: the generation request both doors map onto;
- :mod:`.sampling`: the sampler settings and their bounds;
- :mod:`.constraint`: a constraint on the output (JSON schema, regex,
  choice, grammar) and its limits;
- :mod:`.tools`: tools, tool choices and tool calls, the formats models
  write them in, and the reader that finds them in generated text;
- :mod:`.results`: released text, finish reasons, log-probability entries;
- :mod:`.rules`: the rule kit that reads and checks a wire value
  (:class:`~.rules.Rule`, :func:`~.rules.wire_field`), with :mod:`.strict_json`,
  bounded, non-recursive JSON.
"""

"""Where a sub-agent episode's turns lie in its tokens, for the probes and drills
(warm_start_probe.py, sub_skill_drill.py)."""


def result_span(tokens, tok):
  """[start, end) of the answer after an episode's last `<result>`, up to `</result>` (or
  the end of the tokens); None without a `<result>` or with an empty answer."""
  (result_id,) = tok.encode("<result>")
  if result_id not in tokens:
    return None
  start = len(tokens) - tokens[::-1].index(result_id)
  (close,) = tok.encode("</result>")
  end = tokens.index(close, start) if close in tokens[start:] else len(tokens)
  return (start, end) if end > start else None

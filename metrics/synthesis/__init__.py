"""Synthetic question/answer sets from real documents (`tracejudge dataset synthesize`).

`chunks` reads documents (a folder of text and Markdown, a JSON Lines file of chunks, the retrieved
context of result files) into deduplicated, ordered chunks, counting what it skips; `prompts` holds the
two generation steps as judges (questions from a chunk, a reference answer from the chunk alone), so
they run on the judges' machinery (budgets, spend caps, breaker, redaction at egress); `filters` drops
near-duplicate questions and questions that quote their answer; `runner` runs the steps and the
answerability check for one chunk at a time.
"""

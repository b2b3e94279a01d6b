"""``skip_code`` records the code objects dynamo is told to run uncompiled."""

SKIPPED = []


def skip_code(code):
    SKIPPED.append(code)

"""Marked sections of a generated page: a benchmark that owns one section of a page another
benchmark writes (``docs/benchmarks.md``) replaces only the text between its markers."""
import re


def update_section(path, section, begin, end):
    """Replace the text from ``begin`` to ``end`` (markers included) in ``path`` by ``section``,
    or append ``section`` when the markers are not there (or the file does not exist).

    Args:
        path: the page. section: the new text, starting with ``begin`` and ending with ``end``.
        begin, end: the section's marker lines.
    """
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        text = ""
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end) + r"\n?", re.S)
    if pattern.search(text):
        text = pattern.sub(lambda _: section, text)
    else:
        text = text.rstrip("\n") + ("\n\n" if text else "") + section
    with open(path, "w") as f:
        f.write(text)

"""Files that never tear: atomic writes with the user's umask (:mod:`nestfed.io.atomic`); and the
one Markdown table writer of every report and bench table (:mod:`nestfed.io.markdown`)."""

"""Files that never tear: atomic writes with the user's umask (`nestfed.io.atomic`); and the
one Markdown table writer of every report and bench table (`nestfed.io.markdown`)."""

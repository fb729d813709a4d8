"""Files that never tear: atomic writes with the user's umask (:mod:`nestfed.io.atomic`)."""

"""Files in and out of a session, through its kernel (``session.files``)."""

"""Chat: rendering a conversation through the model's template (``template``)
and the terminal chat (``repl``)."""

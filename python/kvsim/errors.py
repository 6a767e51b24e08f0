"""kvsim.KvsimError: bad input (files, traces, configs, policies, arguments), with the CLI's one-line message."""


class KvsimError(ValueError):
    """Raised for bad input. str(e) is the message the CLI prints after "kvsim: error: "; e.code is the kind
    ("invalid_argument", "not_found", "data_loss", "failed_precondition", "internal")."""

    def __init__(self, message, code="invalid_argument"):
        super().__init__(message)
        self.message = message
        self.code = code

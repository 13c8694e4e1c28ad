"""The run's TLS server context, built from PEM text (the driver reads files; shard hosts get text)."""
from __future__ import annotations

import os
import shutil
import ssl
import tempfile


def server_context(cert_pem: str | None, key_pem: str | None) -> ssl.SSLContext | None:
    """A TLS server context for the certificate and key in PEM text (None: the run is not TLS).

    ``ssl`` loads a certificate chain only from files, so the two texts are written to a fresh
    0700 directory for the duration of the load and removed at once: the key is never readable
    by another user and never outlives the call on disk.
    """
    if cert_pem is None or key_pem is None:
        return None
    folder = tempfile.mkdtemp(prefix="sparkdl-tls-")
    try:
        cert, key = os.path.join(folder, "cert.pem"), os.path.join(folder, "key.pem")
        for path, text in ((cert, cert_pem), (key, key_pem)):
            with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as handle:
                handle.write(text)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert, key)
        return context
    finally:
        shutil.rmtree(folder, ignore_errors=True)

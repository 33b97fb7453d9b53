"""Security: who a certificate names (:mod:`~pliant.security.identity`), issuing certificates
(:mod:`~pliant.security.issuance`), TLS directories (:mod:`~pliant.security.tlsdir`), gRPC credentials
(:mod:`~pliant.security.credentials`), join tokens (:mod:`~pliant.security.tokens`), sealing
(:mod:`~pliant.security.seal`) and the control plane's warrants (:mod:`~pliant.security.warrant`). At the bottom of
the import graph: it imports nothing of pliant but its errors.
"""

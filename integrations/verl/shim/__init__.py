"""The directory :func:`integrations.verl.install` puts first on ``sys.path`` and ``$PYTHONPATH``: its
``transfer_queue`` package is dataplane's verl facade."""

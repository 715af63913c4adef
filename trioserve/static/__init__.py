"""The chat page's files (HTML, CSS, JavaScript), shipped as package data and
served at ``/`` by :mod:`trioserve.server.page`."""

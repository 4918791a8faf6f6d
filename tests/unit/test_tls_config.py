"""TLS config sections: files come in complete sets, and the credentials builders read them."""

from __future__ import annotations

import pytest

from specmesh.config import ConfigError, load_config
from specmesh.rpc import server


def test_tls_is_off_by_default():
    cfg = load_config(environ={})
    assert cfg.tls.public.cert_file is None and cfg.tls.mesh.ca_file is None
    assert server.public_server_credentials(cfg.tls.public) is None


@pytest.mark.parametrize("section, files, key", [
    ("public", {"cert_file": "c.pem"}, "tls.public:"),
    ("public", {"client_ca_file": "ca.pem"}, "tls.public.client_ca_file:"),
    ("mesh", {"cert_file": "c.pem", "key_file": "k.pem"}, "tls.mesh:"),
])
def test_incomplete_file_sets_are_refused(section, files, key):
    with pytest.raises(ConfigError) as exc:
        load_config(environ={}, overrides={"tls": {section: files}})
    assert str(exc.value).startswith(key)

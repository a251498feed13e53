"""Byte-range reads on S3 retry in one layer: botocore's, `retries` times, through a real proxy on
127.0.0.1 in front of moto_server that answers the first requests with S3's 503 SlowDown."""
import http.client
import http.server
import threading
from urllib.parse import urlsplit

import pytest

from deepspec.cache.read.ranges import ByteRanges

SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
             b"<Message>Please reduce your request rate.</Message></Error>")


class FaultyProxy:
    """Forwards every request to `upstream`, except the first `fail` GETs with a Range header, which
    get a 503 SlowDown; counts the ranged GETs it saw."""

    def __init__(self, upstream: str, fail: int):
        self.fail, self.ranged = fail, 0
        host = urlsplit(upstream).netloc
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def _forward(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.command == "GET" and "Range" in self.headers:
                    outer.ranged += 1
                    if outer.ranged <= outer.fail:
                        self.send_response(503)
                        self.send_header("Content-Type", "application/xml")
                        self.send_header("Content-Length", str(len(SLOW_DOWN)))
                        self.end_headers()
                        self.wfile.write(SLOW_DOWN)
                        return
                conn = http.client.HTTPConnection(host, timeout=30)
                conn.request(self.command, self.path, body=body or None,
                             headers={k: v for k, v in self.headers.items() if k.lower() != "host"} | {"Host": host})
                resp = conn.getresponse()
                data = resp.read()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("content-length", "transfer-encoding", "connection", "server", "date"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                conn.close()

            do_GET = do_PUT = do_HEAD = do_POST = do_DELETE = _forward

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()


@pytest.mark.parametrize("retries, fail, ok", [(2, 2, True), (1, 2, False)])
def test_a_range_read_retries_exactly_retries_times(moto, retries, fail, ok):
    bucket = moto.bucket(f"ranges-{retries}-{fail}")
    moto.client().put_object(Bucket=bucket, Key="store/parts/p/data", Body=bytes(range(256)) * 16)
    proxy = FaultyProxy(moto.endpoint, fail)
    try:
        options = {"endpoint_url": proxy.endpoint, "key": "testing", "secret": "testing"}
        ranges = ByteRanges(f"s3://{bucket}/store", options, retries=retries)
        if ok:
            assert ranges.read("parts/p/data", 10, 20) == bytes(range(10, 20))
            assert proxy.ranged == fail + 1  # the failures, then the answer
        else:
            with pytest.raises(OSError):
                ranges.read("parts/p/data", 10, 20)
            assert proxy.ranged == retries + 1  # no second layer tries again on top
    finally:
        proxy.close()

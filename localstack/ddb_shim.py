"""Stand-in for the DynamoDB Local Java process that LocalStack launches.

LocalStack's DynamoDB provider starts `$JAVA_HOME/bin/java ... -jar DynamoDBLocal.jar
-port P ...` and proxies DynamoDB requests to 127.0.0.1:P.  `localstack/up` puts a
tiny `java` script in that place which runs this file instead: moto's DynamoDB
backend (Apache-2.0, shipped with localstack-core) on the same port.

moto's stock server is threaded and not atomic across concurrent requests (two
conditional writes on one item can both pass).  Real DynamoDB serialises writes per
item, so this server handles one request at a time: concurrency tests then test the
consumer's code, not the emulator's races.
"""

import sys

from moto.server import create_backend_app
from werkzeug.serving import run_simple


def main(argv: list[str]) -> None:
    port = None
    for i, arg in enumerate(argv):
        if arg == "-port" and i + 1 < len(argv):
            port = int(argv[i + 1])
    if port is None:
        sys.exit("ddb_shim: no -port argument given")

    # HTTP/1.0 on purpose: one request per connection, so a pooled idle
    # connection can never hold the single request slot.
    app = create_backend_app("dynamodb")
    run_simple("127.0.0.1", port, app, threaded=False, processes=1, use_reloader=False)


if __name__ == "__main__":
    main(sys.argv[1:])

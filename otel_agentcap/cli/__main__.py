from otel_agentcap.cli.commands import main

raise SystemExit(main())

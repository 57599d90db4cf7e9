from frontend_svc.cli import main

raise SystemExit(main())

from scheduler_svc.cli import main

main()
